/* The entity page: recent derived values as charts, the anomalies on it, the decisions about it. */
"use strict";

(() => {
  const { el, api, entityLink, roleBadge } = FW;
  const path = location.pathname.slice("/entity/".length).split("/").map(decodeURIComponent).join("/");
  const KIND = { nic_port: "NIC port", gpu: "GPU", switch_port: "switch port", node: "node", switch: "switch",
                 rank: "training rank" };
  let timer = null;

  function charts(view) {
    if (!view.metrics) return null;
    const s = view.series;
    return el("section", { class: "panel", "aria-labelledby": "charts-h" },
      el("h2", { id: "charts-h" }, `Recent values (${s.t_ms.length} samples)`),
      el("div", { class: "charts" }, view.metrics.map(m => {
        const values = s[m.name] || [];
        const known = values.filter(v => v !== null);
        const latest = known.length ? known[known.length - 1] : null;
        return el("figure", { class: "chart", "data-metric": m.name },
          el("figcaption", {}, el("strong", {}, m.title), ` (${m.unit}) · latest ${FW.num(latest, 2)}`),
          Charts.line(s.t_ms, values, m.title, m.unit));
      })));
  }

  function anomalies(view) {
    const list = view.anomalies;
    return el("section", { class: "panel", "aria-labelledby": "anom-h" },
      el("h2", { id: "anom-h" }, `Anomalies (${list.filter(a => a.lifecycle !== "resolved").length} open, `
        + `${list.filter(a => a.lifecycle === "resolved").length} resolved)`),
      list.length ? el("ul", { class: "plain anoms", id: "entity-anomalies" }, list.map(a => {
        const li = FW.anomalyItem(a, true);
        li.insertBefore(el("span", { class: "badge act rel" }, a.relation === "entity" ? "on this entity" : "related (victim / peer)"),
          li.querySelector(".summary"));
        return li;
      })) : el("p", { class: "muted" }, "None in memory."));
  }

  function decisions(view) {
    const list = view.decisions;
    return el("section", { class: "panel", "aria-labelledby": "dec-h" },
      el("h2", { id: "dec-h" }, `Actions taken or proposed (${list.length})`),
      list.length ? el("ul", { class: "plain anoms", id: "entity-decisions" }, list.map(FW.decisionItem))
        : el("p", { class: "muted" }, "No decisions about it."));
  }

  function children(view) {
    if (!view.children) return null;
    return el("section", { class: "panel", "aria-labelledby": "parts-h" },
      el("h2", { id: "parts-h" }, view.kind === "node" ? "NIC ports and GPUs" : "Ports"),
      el("ul", { class: "plain" }, view.children.map(c => el("li", {}, roleBadge(c.health), entityLink(c.path, c.label)))));
  }

  async function render() {
    const main = document.getElementById("main");
    let view;
    try {
      view = await api("/api/entity/" + path.split("/").map(encodeURIComponent).join("/"));
    } catch (err) {
      main.replaceChildren(el("h1", {}, path), el("p", { role: "alert" }, err.message),
        el("p", {}, el("a", { href: "/" }, "Back to the fabric")));
      return;
    }
    document.title = `${path} · fabricwatch`;
    const crumbs = el("nav", { "aria-label": "breadcrumb", class: "kv" }, el("a", { href: "/" }, "Fabric"),
      view.parent ? [" › ", entityLink(view.parent)] : null, " › ", path);
    const facts = el("dl", { class: "facts" },
      el("dt", {}, "kind"), el("dd", {}, KIND[view.kind] || view.kind),
      el("dt", {}, "health"), el("dd", { id: "entity-health" }, roleBadge(view.health)),
      view.peer ? [el("dt", {}, "cabled to"), el("dd", {}, entityLink(view.peer))] : null,
      view.role ? [el("dt", {}, "role"), el("dd", {}, view.role)] : null,
      view.silent ? [el("dt", {}, "telemetry"), el("dd", {}, "no data recently (source silent)")] : null);
    FW.replaceKeepingFocus(main, crumbs, el("h1", {}, path), el("div", { class: "panel" }, facts),
      el("div", { class: "cards" }, charts(view), anomalies(view), decisions(view), children(view)));
  }

  FW.header("entity");
  render();
  setInterval(render, 5000);
  FW.live("", () => { clearTimeout(timer); timer = setTimeout(render, 400); });
})();
