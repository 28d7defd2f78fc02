/* The live feed: anomalies and action decisions, filtered, pushed by server-sent events. */
"use strict";

(() => {
  const { el, api } = FW;
  const params = new URLSearchParams(location.search);
  const filters = { kind: params.get("kind") || "", severity: params.get("severity") || "",
                    job: params.get("job") || "", switch: params.get("switch") || "" };
  let source = null, list = null;

  function query() {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(filters)) if (v) q.set(k, v);
    return q.toString();
  }

  function item(entry) {
    return entry.type === "anomaly" ? FW.anomalyItem(entry.data, false) : FW.decisionItem(entry.data);
  }

  function form(meta) {
    const kind = el("select", { id: "f-kind", name: "kind" }, el("option", { value: "" }, "any kind"),
      meta.kinds.map(k => el("option", { value: k, selected: k === filters.kind }, k)));
    const severity = el("select", { id: "f-severity", name: "severity" },
      [["", "any severity"], ["info", "info and above"], ["warning", "warning and above"], ["critical", "critical"]]
        .map(([v, t]) => el("option", { value: v, selected: v === filters.severity }, t)));
    const job = el("input", { id: "f-job", name: "job", list: "jobs-list", value: filters.job, placeholder: "job id",
                              autocomplete: "off" });
    const sw = el("input", { id: "f-switch", name: "switch", list: "switch-list", value: filters.switch,
                             placeholder: "switch name", autocomplete: "off" });
    const f = el("form", { class: "filters panel", role: "search", "aria-label": "filter the feed" },
      el("label", { for: "f-kind" }, "Kind", kind), el("label", { for: "f-severity" }, "Severity", severity),
      el("label", { for: "f-job" }, "Job", job), el("label", { for: "f-switch" }, "Switch", sw),
      el("datalist", { id: "jobs-list" }, meta.jobs.map(j => el("option", { value: j }))),
      el("datalist", { id: "switch-list" }, meta.switches.map(s => el("option", { value: s }))),
      el("button", { type: "submit" }, "Apply filters"),
      el("button", { type: "reset" }, "Clear"));
    f.addEventListener("submit", (e) => {
      e.preventDefault();
      Object.assign(filters, { kind: kind.value, severity: severity.value, job: job.value.trim(), switch: sw.value.trim() });
      history.replaceState(null, "", "/feed" + (query() ? "?" + query() : ""));
      load(false);
    });
    f.addEventListener("reset", () => setTimeout(() => f.requestSubmit(), 0));
    return f;
  }

  async function load(first) {
    const main = document.getElementById("main");
    let meta;
    try {
      meta = await api("/api/feed?limit=300" + (query() ? "&" + query() : ""));
    } catch (err) {
      main.replaceChildren(el("h1", {}, "Feed"), el("p", { role: "alert" }, err.message));
      return;
    }
    list = el("ol", { class: "feed panel", id: "feed-list", "aria-live": "polite", "aria-relevant": "additions",
                      "aria-label": "anomalies and decisions, newest first" }, meta.items.map(item));
    const note = el("p", { class: "kv" }, "Newest first. Decisions marked ", el("span", { class: "badge would-have" }, "WOULD HAVE"),
      " were taken in shadow mode: the policy matched, nothing was executed.");
    if (first) main.replaceChildren(el("h1", {}, "Anomaly and action feed"), form(meta), note, list);
    else main.replaceChildren(main.querySelector("h1"), main.querySelector("form"), main.querySelector("p.kv"), list);
    if (!meta.items.length) list.append(el("li", { class: "muted empty" }, "Nothing matches yet; new events appear here live."));
    if (source) source.close();
    source = FW.live(query(), (type, data) => {
      if (type === "dropped") {
        list.prepend(el("li", { class: "muted" }, `${data} updates were skipped (this tab fell behind); reload for all.`));
        return;
      }
      const empty = list.querySelector("li.empty");
      if (empty) empty.remove();
      const li = item({ type, data });
      li.classList.add("new");
      list.prepend(li);
      while (list.children.length > 500) list.lastChild.remove();
    });
  }

  FW.header("feed");
  load(true);
})();
