/* fabricwatch dashboard: helpers shared by every view (no framework, no build step). */
"use strict";

const FW = (() => {
  const ROLE_CODE = { source: "SRC", downgraded: "DWN", straggler: "STR", fault: "FLT", victim: "VIC", ok: "OK" };

  /** el("a", {href: "/x", class: "c"}, "text", child...) -> Element */
  function el(tag, attrs, ...children) {
    const svg = ["svg", "path", "circle", "line", "text", "g", "polyline", "title", "rect"].includes(tag);
    const node = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k.startsWith("on") && typeof v === "function") node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat(Infinity)) {
      if (c === undefined || c === null || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  async function api(path) {
    const resp = await fetch(path, { headers: { Accept: "application/json" } });
    const body = await resp.json().catch(() => ({}));
    if (!resp.ok) throw new Error(body.error || `${resp.status} ${resp.statusText}`);
    return body;
  }

  function entityHref(path) {
    return "/entity/" + path.split("/").map(encodeURIComponent).join("/");
  }

  function entityLink(path, text) {
    return path ? el("a", { href: entityHref(path) }, text || path) : el("span", { class: "muted" }, text || "—");
  }

  function roleBadge(health) {
    const role = (health && health.role) || "ok";
    return el("span", { class: `badge role-${role}`, title: (health && health.label) || role },
      `${ROLE_CODE[role]} · ${(health && health.label) || role}`);
  }

  function clock(ms) {
    if (!ms) return "—";
    const d = new Date(ms);
    return d.toLocaleTimeString([], { hour12: false });
  }

  function timeEl(ms) {
    return el("time", { datetime: new Date(ms).toISOString() }, clock(ms));
  }

  function num(v, digits = 1) {
    return v === null || v === undefined ? "—" : Number(v).toFixed(digits);
  }

  /** An anomaly as a list item: time, lifecycle, severity, kind, summary, entity link. */
  function anomalyItem(a, withEvidence) {
    const li = el("li", { class: "anomaly", "data-kind": a.kind, "data-dedup": a.dedup_key },
      timeEl(a.detected_unix_ms),
      el("span", { class: `badge lc-${a.lifecycle}` }, a.lifecycle.toUpperCase()),
      el("span", { class: `badge sev-${a.severity}` }, a.severity),
      el("strong", {}, a.kind), " ",
      entityLink(a.entity.path), " ", impactBadge(a),
      el("div", { class: "summary" }, a.summary));
    if (a.probable_cause) li.append(el("div", { class: "kv" }, "probable cause: " + a.probable_cause));
    if (withEvidence && a.suggested_action) li.append(el("div", { class: "kv" }, "suggested: " + a.suggested_action));
    if (withEvidence && a.evidence.length) li.append(evidenceTable(a.evidence));
    return li;
  }

  /** "12.3 GPU-h · +64/h": what an anomaly cost so far (by now, when open) and its rate; "≈" when estimated. */
  function impactBadge(a) {
    if (!a.impact_basis) return "";
    const lost = a.impact_gpu_hours_now ?? a.impact_gpu_hours ?? 0;
    const est = a.impact_basis === "estimated";
    const rate = a.lifecycle !== "resolved" ? ` · +${num(a.impact_gpu_hours_per_hour ?? 0, 2)}/h` : "";
    return el("span", { class: "badge impact" + (est ? " estimated" : ""), "data-impact": String(lost),
      title: `GPU-hours lost${rate ? " so far, and per hour while open" : ""} (${a.impact_basis})` },
      `${est ? "≈" : ""}${num(lost, 2)} GPU-h${rate}`);
  }

  function evidenceTable(evidence) {
    return el("table", { class: "data evidence" },
      el("caption", { class: "muted" }, "evidence"),
      el("thead", {}, el("tr", {}, el("th", {}, "name"), el("th", { class: "num" }, "value"),
        el("th", { class: "num" }, "threshold"), el("th", {}, "unit"), el("th", {}, "detail"))),
      el("tbody", {}, evidence.map(x => el("tr", {},
        el("td", {}, x.name), el("td", { class: "num" }, num(x.value, 3)),
        el("td", { class: "num" }, x.threshold ? num(x.threshold, 3) : "—"),
        el("td", {}, x.unit), el("td", {}, x.detail)))));
  }

  /** A decision as a list item; shadow-mode decisions read "WOULD HAVE". */
  function decisionItem(d) {
    const marker = d.would_have
      ? el("span", { class: "badge would-have", title: "shadow mode: not executed" }, "WOULD HAVE")
      : el("span", { class: "badge act" }, "ACTION");
    return el("li", { class: "decision" + (d.would_have ? " shadow" : ""), "data-kind": d.anomaly_kind },
      timeEl(d.decided_unix_ms), marker,
      el("strong", {}, d.action), " → ", entityLink(d.target.path), " ",
      el("span", { class: "badge act" }, d.outcome.replace(/_/g, " ")),
      el("div", { class: "kv" }, `rule ${d.rule || "—"} · ${d.anomaly_kind} · ${d.executor || "no executor"}`
        + (d.reason ? ` · ${d.reason}` : "") + (d.detail ? ` · ${d.detail}` : "")));
  }

  /** Server-sent events with the given query; calls onEvent(type, data), shows connection state. */
  function live(query, onEvent) {
    const source = new EventSource("/api/events" + (query ? "?" + query : ""));
    const mark = document.querySelector("#status .live");
    const set = (on) => { if (mark) { mark.className = "live " + (on ? "on" : "off"); mark.textContent = on ? "live" : "reconnecting"; } };
    source.onopen = () => set(true);
    source.onerror = () => set(false);
    for (const type of ["anomaly", "decision", "dropped"]) {
      source.addEventListener(type, (e) => onEvent(type, JSON.parse(e.data)));
    }
    return source;
  }

  async function status() {
    const box = document.getElementById("status-text");
    if (!box) return;
    try {
      const s = await api("/api/status");
      const feed = s.feed.state === "error" ? ` · Kafka: ${s.feed.error}` : "";
      box.textContent = `${s.nodes} nodes · ${s.switches} switches · ${s.open_anomalies} open · `
        + `data ${clock(s.latest_event_unix_ms)}${feed}`;
    } catch (err) {
      box.textContent = "dashboard unreachable: " + err.message;
    }
  }

  /** Roving tabindex over the <a class="cell"> of a table: one Tab stop, arrows move, Enter opens. */
  function gridKeys(table) {
    const cells = () => Array.from(table.querySelectorAll("a.cell"));
    const all = cells();
    if (!all.length) return;
    if (!all.some(c => c.tabIndex === 0)) all[0].tabIndex = 0;
    table.addEventListener("keydown", (e) => {
      const cell = e.target.closest("a.cell");
      if (!cell) return;
      const td = cell.closest("td"), tr = td.parentElement;
      const row = Array.from(tr.querySelectorAll("a.cell"));
      const i = row.indexOf(cell);
      const rows = Array.from(table.querySelectorAll("tr")).filter(r => r.querySelector("a.cell"));
      const r = rows.indexOf(tr);
      let next = null;
      if (e.key === "ArrowRight") next = row[i + 1];
      else if (e.key === "ArrowLeft") next = row[i - 1];
      else if (e.key === "Home") next = row[0];
      else if (e.key === "End") next = row[row.length - 1];
      else if (e.key === "ArrowDown" || e.key === "ArrowUp") {
        const other = rows[r + (e.key === "ArrowDown" ? 1 : -1)];
        if (other) { const o = Array.from(other.querySelectorAll("a.cell")); next = o[Math.min(i, o.length - 1)]; }
      } else if (e.key === " ") { e.preventDefault(); cell.click(); return; }
      if (next) {
        e.preventDefault();
        for (const c of cells()) c.tabIndex = -1;
        next.tabIndex = 0;
        next.focus();
      }
    });
  }

  /** Replace main's content, keeping the keyboard focus on the same control or link if it is still there. */
  function replaceKeepingFocus(main, ...nodes) {
    const a = document.activeElement;
    let key = null, index = 0;
    if (a && a !== main && main.contains(a)) {
      key = a.id ? "#" + CSS.escape(a.id)
        : a.getAttribute("href") ? `[href="${CSS.escape(a.getAttribute("href"))}"]` : null;
      if (key) index = Array.from(main.querySelectorAll(key)).indexOf(a);
    }
    main.replaceChildren(...nodes.flat(Infinity).filter(Boolean));
    if (key) {
      const again = main.querySelectorAll(key)[Math.max(0, index)];
      if (again) again.focus({ preventScroll: true });
    }
  }

  function header(current) {
    for (const a of document.querySelectorAll("header.top nav a")) {
      if (a.dataset.view === current) a.setAttribute("aria-current", "page");
    }
    status();
    setInterval(status, 5000);
  }

  return { el, api, entityHref, entityLink, roleBadge, clock, timeEl, num, anomalyItem, impactBadge, decisionItem,
           evidenceTable, live, gridKeys, header, replaceKeepingFocus, ROLE_CODE };
})();
