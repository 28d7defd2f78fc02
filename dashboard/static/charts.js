/* Inline-SVG charts for the dashboard: a time-series line chart and a sparkline. */
"use strict";

const Charts = (() => {
  const W = 440, H = 150, PAD = { l: 44, r: 10, t: 8, b: 22 };

  /** [lo, hi] rounded outwards to a 1-2-5 step; non-negative data starts at 0 when that is close. */
  function niceRange(values) {
    let lo = Math.min(...values), hi = Math.max(...values);
    if (lo === hi) {
      if (lo === 0) return [0, 1];
      const d = Math.abs(lo) * 0.1;
      lo = lo > 0 && lo - d < d ? 0 : lo - d; hi += d;
    }
    if (lo > 0 && lo < (hi - lo)) lo = 0;        // rates and duties read best from zero
    const raw = (hi - lo) / 5, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map(m => m * mag).find(s => s >= raw) || 10 * mag;
    return [Math.floor(lo / step + 1e-9) * step, Math.ceil(hi / step - 1e-9) * step];
  }

  function fmt(v) {
    const a = Math.abs(v);
    return a >= 100 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : v.toFixed(2);
  }

  /** times: unix ms; values: numbers or null (gaps). Returns an <svg> with one circle.pt per point. */
  function line(times, values, label, unit) {
    const { el } = FW;
    const pts = times.map((t, i) => [t, values[i]]).filter(p => p[1] !== null && p[1] !== undefined);
    const svg = el("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img",
      "aria-label": `${label} (${unit}): ${pts.length} points` + (pts.length ? `, latest ${fmt(pts[pts.length - 1][1])}` : "") });
    const x0 = PAD.l, x1 = W - PAD.r, y0 = H - PAD.b, y1 = PAD.t;
    svg.append(el("line", { class: "axis", x1: x0, y1: y0, x2: x1, y2: y0 }),
               el("line", { class: "axis", x1: x0, y1: y0, x2: x0, y2: y1 }));
    if (!pts.length) {
      svg.append(el("text", { x: (x0 + x1) / 2, y: (y0 + y1) / 2, "text-anchor": "middle" }, "no data yet"));
      return svg;
    }
    const tMin = times[0], tMax = Math.max(times[times.length - 1], tMin + 1);
    const [lo, hi] = niceRange(pts.map(p => p[1]));
    const sx = t => x0 + (t - tMin) / (tMax - tMin) * (x1 - x0);
    const sy = v => y0 - (v - lo) / (hi - lo) * (y0 - y1);
    for (const v of [lo, (lo + hi) / 2, hi]) {
      svg.append(el("line", { class: "gridline", x1: x0, y1: sy(v), x2: x1, y2: sy(v) }),
                 el("text", { x: x0 - 4, y: sy(v) + 3, "text-anchor": "end" }, fmt(v)));
    }
    svg.append(el("text", { x: x0, y: H - 6 }, FW.clock(tMin)),
               el("text", { x: x1, y: H - 6, "text-anchor": "end" }, FW.clock(tMax)));
    // One path, broken where a value is missing (no rate across a reset or the first sample).
    let d = "", pen = false;
    times.forEach((t, i) => {
      const v = values[i];
      if (v === null || v === undefined) { pen = false; return; }
      d += `${pen ? "L" : "M"}${sx(t).toFixed(1)},${sy(v).toFixed(1)}`;
      pen = true;
    });
    svg.append(el("path", { class: "line", d }));
    const g = el("g", { class: "points" });
    for (const [t, v] of pts) {
      g.append(el("circle", { class: "pt", cx: sx(t).toFixed(1), cy: sy(v).toFixed(1), r: 1.8 },
        el("title", {}, `${FW.clock(t)}: ${fmt(v)} ${unit}`)));
    }
    svg.append(g);
    return svg;
  }

  /** A small line of recent step times; `slow` colours it as a straggler. */
  function spark(values, slow) {
    const { el } = FW;
    const w = 120, h = 22;
    const svg = el("svg", { class: "spark", viewBox: `0 0 ${w} ${h}`, role: "img",
      "aria-label": `step times: ${values.map(v => v.toFixed(2)).join(", ")} s` });
    if (values.length < 2) return svg;
    const [lo, hi] = niceRange(values);
    const pts = values.map((v, i) => `${(i / (values.length - 1) * (w - 2) + 1).toFixed(1)},`
      + `${(h - 2 - (v - lo) / (hi - lo) * (h - 4)).toFixed(1)}`);
    svg.append(el("polyline", { class: "line" + (slow ? " slow" : ""), points: pts.join(" ") }));
    return svg;
  }

  return { line, spark };
})();
