/* The jobs view: each job's ranks and recent step times, stragglers with their probable cause. */
"use strict";

(() => {
  const { el, api, entityLink } = FW;
  const FULL_TABLE_MAX = 64;     // bigger jobs list their stragglers first, the rest folded away
  let timer = null;

  function rankRow(job, r) {
    const slow = !!r.straggler;
    return el("tr", { class: slow ? "straggler" : "", "data-rank": r.rank },
      el("td", { class: "num" }, r.rank),
      el("td", {}, entityLink(r.node)),
      el("td", {}, entityLink(r.gpu_path, `gpu${r.local_gpu}`)),
      el("td", { class: "num" }, r.last_step ?? "—"),
      el("td", {}, Charts.spark(r.step_s, slow), " ", r.step_s.length ? `${r.step_s[r.step_s.length - 1].toFixed(2)} s` : "—"),
      el("td", { class: "num" }, FW.num(r.busy_s, 2)),
      el("td", { class: "num" }, FW.num(r.wait_s, 2)),
      el("td", {}, slow ? [el("span", { class: "badge role-straggler" }, "STR · straggler"),
        el("div", { class: "kv" }, "probable cause: " + (r.straggler.probable_cause || "unknown"))] : "ok"));
  }

  function rankTable(job, ranks, caption) {
    return el("table", { class: "data ranks" },
      el("caption", { class: "muted" }, caption),
      el("thead", {}, el("tr", {}, ["rank", "node", "GPU", "step", "recent step times", "busy s", "wait s", "status"]
        .map((h, i) => el("th", { scope: "col", class: [0, 3, 5, 6].includes(i) ? "num" : "" }, h)))),
      el("tbody", {}, ranks.map(r => rankRow(job, r))));
  }

  function jobSection(job) {
    const slow = job.ranks.filter(r => r.straggler);
    const head = el("h2", { id: `job-${job.job}` }, job.job, " ",
      slow.length ? el("span", { class: "badge role-straggler" }, `${slow.length} straggler${slow.length > 1 ? "s" : ""}`)
        : el("span", { class: "badge role-ok" }, "OK · no straggler"));
    const facts = el("p", { class: "kv" }, `world size ${job.world_size} · ${job.ranks_seen} ranks seen on `
      + `${job.nodes.length} nodes · median last step ${FW.num(job.median_step_s, 2)} s`
      + (job.dropped_ranks ? ` · ${job.dropped_ranks} ranks over the limit not shown` : ""));
    const parts = [head, facts];
    for (const r of slow) {
      parts.push(el("p", { class: "summary" }, el("strong", {}, `rank ${r.rank}: `), r.straggler.summary));
    }
    if (job.ranks.length <= FULL_TABLE_MAX) parts.push(rankTable(job, job.ranks, "ranks"));
    else {
      if (slow.length) parts.push(rankTable(job, slow, "stragglers"));
      parts.push(el("details", {}, el("summary", {}, `all ${job.ranks.length} ranks`), rankTable(job, job.ranks, "ranks")));
    }
    return el("section", { class: "panel job", "aria-labelledby": `job-${job.job}`, "data-job": job.job }, parts);
  }

  async function render() {
    const main = document.getElementById("main");
    let data;
    try {
      data = await api("/api/jobs");
    } catch (err) {
      main.replaceChildren(el("h1", {}, "Jobs"), el("p", { role: "alert" }, err.message));
      return;
    }
    const open = new Set(Array.from(main.querySelectorAll("details[open]")).map(d => d.closest("section").dataset.job));
    const jobs = data.jobs.slice().sort((a, b) => b.stragglers.length - a.stragglers.length || a.job.localeCompare(b.job));
    FW.replaceKeepingFocus(main, el("h1", {}, `Jobs (${jobs.length})`),
      jobs.length ? el("div", { class: "cards" }, jobs.map(jobSection))
        : el("p", { class: "muted" }, "No rank-step records yet (training scripts report them with fabricwatch.rank)."));
    for (const d of main.querySelectorAll("details")) if (open.has(d.closest("section").dataset.job)) d.open = true;
  }

  FW.header("jobs");
  render();
  setInterval(render, 5000);
  FW.live("", () => { clearTimeout(timer); timer = setTimeout(render, 400); });
})();
