/* The fabric view: nodes x NIC rails (and GPUs) and the switches, coloured by health. */
"use strict";

(() => {
  const { el, api, entityHref, entityLink, ROLE_CODE } = FW;
  const PAGE = 256;
  let offset = 0, problemsOnly = false, timer = null;

  /** One heat-map cell: the role's code as text; a silent source reads "—" unless an anomaly names it. */
  function cell(path, health, label, extra, silent) {
    if (!path) return el("td", {}, el("span", { class: "cell role-none", "aria-hidden": "true" }, ""));
    const role = health ? health.role : "ok";
    const quiet = silent && role === "ok";
    const text = `${label}: ${quiet ? "no data (source silent)" : health ? health.label : "healthy"}`
      + (silent && !quiet ? " (no recent data)" : extra || "");
    return el("td", { role: "gridcell" },
      el("a", { class: quiet ? "cell silent" : `cell role-${role}` + (silent ? " stale" : ""), href: entityHref(path),
                tabindex: -1, "data-path": path, "data-role": quiet ? "silent" : role, "aria-label": text, title: text },
        quiet ? "—" : ROLE_CODE[role]));
  }

  function heatmap(view) {
    const head = el("tr", {}, el("th", { class: "node", scope: "col" }, "node"),
      el("th", { class: "group", colspan: view.rails.length, scope: "colgroup" }, "NIC rails"),
      el("td", { class: "gap" }),
      el("th", { class: "group", colspan: view.gpus, scope: "colgroup" }, "GPUs"));
    const sub = el("tr", {}, el("th", {}),
      view.rails.map(r => el("th", { scope: "col" }, `r${r}`)), el("td", { class: "gap" }),
      Array.from({ length: view.gpus }, (_, g) => el("th", { scope: "col" }, `g${g}`)));
    const rows = view.rows.map(row => el("tr", {},
      el("th", { class: "node", scope: "row" },
        el("a", { href: entityHref(row.node), class: row.health.role === "ok" ? "" : `badge role-${row.health.role}`,
                  title: row.health.label }, row.node)),
      row.nics.map(c => cell(c.path, c.health, `${row.node} rail ${c.rail} ${c.id}`,
        c.tx_gbps !== null && c.tx_gbps !== undefined ? `, tx ${c.tx_gbps.toFixed(1)} Gb/s` : "", row.silent)),
      el("td", { class: "gap" }),
      row.gpus.map(g => cell(g.path, g.health, `${row.node} gpu${g.index}`,
        g.gpu_util_pct !== null && g.gpu_util_pct !== undefined ? `, ${g.gpu_util_pct.toFixed(0)} % busy` : "",
        row.silent))));
    return el("table", { class: "grid", id: "heatmap", role: "grid",
                         "aria-label": "nodes by NIC rail and GPU; arrow keys move, Enter opens" },
      el("thead", {}, head, sub), el("tbody", {}, rows));
  }

  function switchmap(switches) {
    const leaves = switches.filter(s => s.role !== "spine"), spines = switches.filter(s => s.role === "spine");
    const swCell = s => cell(s.name, s.health, `${s.role} ${s.name} (${s.ports} ports)`, "", s.silent);
    const grid = {};
    let regular = true;
    for (const s of leaves) {
      const m = /-u(\d+)-r(\d+)$/.exec(s.name);
      if (!m) { regular = false; break; }
      (grid[m[1]] = grid[m[1]] || [])[Number(m[2])] = s;
    }
    const rows = [];
    if (regular && leaves.length) {
      for (const unit of Object.keys(grid).sort((a, b) => a - b)) {
        rows.push(el("tr", {}, el("th", { scope: "row", class: "node" }, `leaf unit ${unit}`),
          grid[unit].map((s, r) => s ? swCell(s) : el("td", {}))));
      }
    } else {
      for (let i = 0; i < leaves.length; i += 8) {
        rows.push(el("tr", {}, el("th", { scope: "row", class: "node" }, i ? "" : "leaves"), leaves.slice(i, i + 8).map(swCell)));
      }
    }
    for (let i = 0; i < spines.length; i += 8) {
      rows.push(el("tr", {}, el("th", { scope: "row", class: "node" }, i ? "" : "spines"), spines.slice(i, i + 8).map(swCell)));
    }
    const width = Math.max(8, ...Object.values(grid).map(r => r.length));
    return el("table", { class: "grid", id: "switchmap", role: "grid",
                         "aria-label": "leaf and spine switches; arrow keys move, Enter opens" },
      el("thead", {}, el("tr", {}, el("th", {}), Array.from({ length: width }, (_, r) =>
        el("th", { scope: "col" }, regular ? `r${r}` : "")))),
      el("tbody", {}, rows));
  }

  function legend() {
    const items = [["source", "PFC storm source"], ["victim", "paused by a storm"], ["downgraded", "link below nominal"],
                   ["straggler", "slow rank / its GPU"], ["fault", "other fault"], ["ok", "healthy"]];
    return el("div", { class: "legend", "aria-label": "legend" },
      items.map(([role, text]) => el("span", {}, el("span", { class: `cell role-${role}` }, ROLE_CODE[role]), " ", text)),
      el("span", {}, el("span", { class: "cell silent" }, "—"), " no data"),
      el("span", {}, el("span", { class: "cell role-ok stale" }, "OK"), " dashed: no recent data"));
  }

  function openList(anomalies) {
    if (!anomalies.length) return el("p", { class: "muted" }, "No open anomalies.");
    return el("ul", { class: "plain anoms", id: "open-anomalies" }, anomalies.map(a => {
      const li = FW.anomalyItem(a, false);
      const victims = a.related.filter(r => r.path);
      if (a.kind.startsWith("pfc_storm") && victims.length) {
        li.append(el("div", { class: "kv" }, `victims (${victims.length}): `,
          victims.slice(0, 12).map((r, i) => [i ? ", " : "", entityLink(r.path)]),
          victims.length > 12 ? ` … +${victims.length - 12}` : ""));
      }
      return li;
    }));
  }

  async function render() {
    const main = document.getElementById("main");
    let view;
    try {
      view = await api(`/api/fabric?offset=${offset}&limit=${PAGE}` + (problemsOnly ? "&problems=1" : ""));
    } catch (err) {
      main.replaceChildren(el("p", { role: "alert" }, "Could not load the fabric: " + err.message));
      return;
    }
    const problems = el("input", { type: "checkbox", id: "problems", checked: problemsOnly });
    problems.addEventListener("change", () => { problemsOnly = problems.checked; offset = 0; render(); });
    const pager = el("div", { class: "pager" },
      el("label", {}, problems, " only nodes with problems"),
      view.nodes_total > PAGE ? [
        el("button", { type: "button", disabled: offset === 0, onclick: () => { offset = Math.max(0, offset - PAGE); render(); } }, "◀ previous"),
        el("span", {}, `nodes ${offset + 1}–${Math.min(offset + PAGE, view.nodes_total)} of ${view.nodes_total}`),
        el("button", { type: "button", disabled: offset + PAGE >= view.nodes_total, onclick: () => { offset += PAGE; render(); } }, "next ▶"),
      ] : el("span", { class: "muted" }, `${view.nodes_total} nodes · topology from ${view.topology_source}`));
    const hm = heatmap(view), sm = switchmap(view.switches);
    FW.replaceKeepingFocus(main,
      el("h1", {}, "Fabric"),
      el("div", { class: "layout" },
        el("section", { class: "panel", "aria-labelledby": "hm-h" },
          el("h2", { id: "hm-h" }, "Nodes × NIC rails and GPUs"), legend(), pager,
          el("div", { class: "scroll" }, hm)),
        el("div", { class: "cards" },
          el("section", { class: "panel", "aria-labelledby": "open-h" },
            el("h2", { id: "open-h" }, `Open anomalies (${view.open_total ?? view.open_anomalies.length})`), openList(view.open_anomalies)),
          el("section", { class: "panel", "aria-labelledby": "sw-h" },
            el("h2", { id: "sw-h" }, "Leaf and spine switches"), sm))));
    const again = document.activeElement;
    if (again && again.matches("a.cell")) {     // the roving tab stop follows the restored focus
      for (const c of again.closest("table").querySelectorAll("a.cell")) c.tabIndex = -1;
      again.tabIndex = 0;
    }
    for (const table of [hm, sm]) FW.gridKeys(table);
  }

  function soon() {            // coalesce a burst of events into one refresh
    clearTimeout(timer);
    timer = setTimeout(render, 400);
  }

  FW.header("fabric");
  render();
  setInterval(render, 10000);
  FW.live("", soon);
})();
