// Drives the fabricwatch dashboard in a real headless Chromium (Debian's, through playwright-core).
//
//   BASE_URL=http://127.0.0.1:8080 EXPECT='{...}' SCREENSHOT_DIR=dir CHROMIUM=/usr/bin/chromium node dashboard.js
//
// EXPECT (JSON, written by tests/test_dashboard_browser.py): the storm source, its victims,
// the downgraded links, the straggler and the live anomaly to wait for. The script prints
// "waiting-for-live-anomaly" once the feed page is open; the test then produces a new
// anomaly and the script expects it to arrive by server-sent events, without a reload.
// Each check prints "ok <what>"; the first failure exits 1 with its reason.
"use strict";

const path = require("path");
const { chromium } = require("playwright-core");

const BASE = process.env.BASE_URL;
const EXPECT = JSON.parse(process.env.EXPECT || "{}");
const SHOTS = process.env.SCREENSHOT_DIR;
const TIMEOUT_MS = 20000;

function check(cond, what) {
  if (!cond) throw new Error("FAILED: " + what);
  console.log("ok " + what);
}

const cellSel = (table, p) => `#${table} a.cell[data-path="${p}"]`;

async function roleOf(page, table, p) {
  const cell = page.locator(cellSel(table, p));
  await cell.waitFor({ timeout: TIMEOUT_MS });
  return cell.getAttribute("data-role");
}

async function fabricView(page) {
  await page.goto(BASE + "/");
  await page.locator(cellSel("heatmap", EXPECT.source)).waitFor({ timeout: TIMEOUT_MS });
  check(await roleOf(page, "heatmap", EXPECT.source) === "source", `storm source ${EXPECT.source} is marked SRC`);
  check((await page.locator(cellSel("heatmap", EXPECT.source)).textContent()).trim() === "SRC",
        "the source cell says SRC in text, not only in colour");
  const victims = EXPECT.victims_in_heatmap;
  check(victims.length > 0, "the storm has NIC victims in the heat map");
  for (const v of victims) check(await roleOf(page, "heatmap", v) === "victim", `victim ${v} is marked VIC`);
  check(await roleOf(page, "switchmap", EXPECT.victim_switch) === "victim", `leaf ${EXPECT.victim_switch} is marked as a victim`);
  check(await roleOf(page, "heatmap", EXPECT.downgraded_nic) === "downgraded", `downgraded link ${EXPECT.downgraded_nic} is marked DWN`);
  check(await roleOf(page, "heatmap", EXPECT.straggler_gpu) === "straggler", `straggler GPU ${EXPECT.straggler_gpu} is marked STR`);
  const open = await page.locator("#open-anomalies").textContent();
  check(open.includes("pfc_storm") && open.includes("link_downgrade") && open.includes("straggler"),
        "open anomalies list the storm, the downgrade and the straggler");
  const width = await page.evaluate(() => document.documentElement.scrollWidth);
  check(width <= 1366, `fabric view fits a 1366 px wide screen (content width ${width})`);
  await page.screenshot({ path: path.join(SHOTS, "fabric.png"), fullPage: false });
}

async function keyboard(page) {
  await page.goto(BASE + "/");
  await page.locator(cellSel("heatmap", EXPECT.source)).waitFor({ timeout: TIMEOUT_MS });
  let onCell = false;
  for (let i = 0; i < 40 && !onCell; i++) {
    await page.keyboard.press("Tab");
    onCell = await page.evaluate(() => !!document.activeElement.closest("#heatmap") && document.activeElement.matches("a.cell"));
  }
  check(onCell, "Tab reaches the heat map");
  const visible = await page.evaluate(() => getComputedStyle(document.activeElement).outlineStyle !== "none");
  check(visible, "the focused cell has a visible focus outline");
  // Walk with the arrow keys to the source cell, then open it with Enter.
  const target = await page.evaluate((p) => {
    const rows = Array.from(document.querySelectorAll("#heatmap tr")).filter(r => r.querySelector("a.cell"));
    const cell = document.querySelector(`#heatmap a.cell[data-path="${p}"]`);
    const tr = cell.closest("tr");
    return { row: rows.indexOf(tr), col: Array.from(tr.querySelectorAll("a.cell")).indexOf(cell) };
  }, EXPECT.source);
  for (let r = 0; r < target.row; r++) await page.keyboard.press("ArrowDown");
  for (let c = 0; c < target.col; c++) await page.keyboard.press("ArrowRight");
  const focused = await page.evaluate(() => document.activeElement.dataset.path);
  check(focused === EXPECT.source, `arrow keys move the focus to ${EXPECT.source}`);
  await Promise.all([page.waitForURL("**/entity/**"), page.keyboard.press("Enter")]);
  check(decodeURIComponent(new URL(page.url()).pathname) === "/entity/" + EXPECT.source, "Enter opens the entity page");
}

async function entityView(page) {
  // (the keyboard step left us on the storm source's page)
  const points = page.locator('figure.chart[data-metric="tx_pause_duty"] circle.pt');
  await points.first().waitFor({ timeout: TIMEOUT_MS });
  const n = await points.count();
  check(n >= 10, `the pause-duty chart draws its data points (${n})`);
  const health = await page.locator("#entity-health").textContent();
  check(health.includes("storm source"), "the entity page names it the storm source");
  const anomalies = await page.locator("#entity-anomalies").textContent();
  check(anomalies.includes("tx_pause_duty") && anomalies.includes("evidence"), "its anomaly shows the evidence");
  const decisions = await page.locator("#entity-decisions").textContent();
  check(decisions.includes("WOULD HAVE") && decisions.includes("drain_node"), "the shadow decision reads 'would have' drain_node");
  await page.screenshot({ path: path.join(SHOTS, "entity.png"), fullPage: false });

  await page.goto(BASE + "/entity/" + EXPECT.downgraded_nic);
  const caption = page.locator('figure.chart[data-metric="link_rate_gbps"] figcaption');
  await caption.waitFor({ timeout: TIMEOUT_MS });
  check((await caption.textContent()).includes("200.00"), "the downgraded link's rate chart reads 200 Gb/s");
  await page.screenshot({ path: path.join(SHOTS, "entity-downgraded.png"), fullPage: false });
}

async function jobsView(page) {
  await page.goto(BASE + "/jobs");
  const row = page.locator(`section[data-job="${EXPECT.straggler_job}"] tr[data-rank="${EXPECT.straggler_rank}"]`).first();
  await row.waitFor({ timeout: TIMEOUT_MS });
  check(await row.evaluate(r => r.classList.contains("straggler")), `rank ${EXPECT.straggler_rank} of ${EXPECT.straggler_job} is marked straggler`);
  const text = await row.textContent();
  check(text.includes("probable cause") && text.toLowerCase().includes(EXPECT.straggler_cause),
        `the straggler shows its probable cause (${EXPECT.straggler_cause})`);
  check(await row.locator("svg.spark polyline").count() === 1, "the straggler's step times are drawn");
  await page.screenshot({ path: path.join(SHOTS, "jobs.png"), fullPage: false });
}

async function feedView(page) {
  await page.goto(BASE + "/feed");
  const list = page.locator("#feed-list");
  await list.locator("li").first().waitFor({ timeout: TIMEOUT_MS });
  check((await list.textContent()).includes("WOULD HAVE"), "the feed marks the shadow decision 'would have'");
  // Filters are real form controls: choose a kind with the keyboard-reachable select, apply.
  await page.selectOption("#f-kind", "pfc_storm");
  await page.click("button[type=submit]");
  await page.waitForFunction(() => {
    const items = Array.from(document.querySelectorAll("#feed-list li[data-kind]"));
    return items.length > 0 && items.every(li => li.dataset.kind === "pfc_storm");
  }, null, { timeout: TIMEOUT_MS });
  check(true, "the kind filter leaves only pfc_storm items");
  check(new URL(page.url()).searchParams.get("kind") === "pfc_storm", "the filter is kept in the URL");
  await page.fill("#f-switch", EXPECT.victim_switch);
  await page.selectOption("#f-kind", "");
  await page.click("button[type=submit]");
  await page.waitForFunction(() => document.querySelectorAll("#feed-list li[data-kind]").length > 0, null, { timeout: TIMEOUT_MS });
  const bySwitch = await page.locator("#feed-list li[data-kind]").evaluateAll(els => els.map(e => e.dataset.kind));
  check(bySwitch.includes("pfc_storm") && !bySwitch.includes("straggler"), `the switch filter (${EXPECT.victim_switch}) keeps the storm, not the straggler`);
  await page.click("button[type=reset]");
  await page.waitForFunction(() => new URL(location.href).search === "", null, { timeout: TIMEOUT_MS });
  await page.waitForFunction(() => document.querySelector("#status .live.on"), null, { timeout: TIMEOUT_MS });

  console.log("waiting-for-live-anomaly");
  const live = page.locator("#feed-list li.new", { hasText: EXPECT.live_summary });
  await live.waitFor({ timeout: 30000 });
  check(true, "a new anomaly arrives in the feed by server-sent events, without a reload");
  const shadow = page.locator("#feed-list li.new.shadow", { hasText: "WOULD HAVE" });
  await shadow.waitFor({ timeout: TIMEOUT_MS });
  check(true, "its shadow decision arrives live, marked 'would have'");
  await page.screenshot({ path: path.join(SHOTS, "feed.png"), fullPage: false });
}

(async () => {
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
                                          args: ["--no-sandbox"] });
  const errors = [];
  try {
    for (const scheme of ["light", "dark"]) {
      const context = await browser.newContext({ viewport: { width: 1366, height: 768 }, colorScheme: scheme });
      const page = await context.newPage();
      page.on("pageerror", e => errors.push(`${scheme}: ${e.message}`));
      page.on("console", m => { if (m.type() === "error") errors.push(`${scheme}: console: ${m.text()}`); });
      if (scheme === "light") {
        await fabricView(page);
        await keyboard(page);
        await entityView(page);
        await jobsView(page);
        await feedView(page);
      } else {                       // the dark scheme: the fabric view, for the screenshot
        await page.goto(BASE + "/");
        await page.locator(cellSel("heatmap", EXPECT.source)).waitFor({ timeout: TIMEOUT_MS });
        await page.screenshot({ path: path.join(SHOTS, "fabric-dark.png"), fullPage: false });
        await page.goto(BASE + "/entity/" + EXPECT.source);
        await page.locator("circle.pt").first().waitFor({ timeout: TIMEOUT_MS });
        await page.screenshot({ path: path.join(SHOTS, "entity-dark.png"), fullPage: false });
      }
      await context.close();
    }
    check(errors.length === 0, "no script errors or blocked resources: " + errors.join(" | "));
  } finally {
    await browser.close();
  }
})().catch((err) => {
  console.error(err.message || err);
  process.exit(1);
});
