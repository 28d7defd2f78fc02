"""`fabricwatch report`: what the fabric did over a window, for the network engineer.

From a recording (replayed through the detectors) or from Kafka (the telemetry and the
anomalies of a time window), per switch and port: PFC pause time sent and received, ECN
marks, the NICs' CNPs, drops, each leaf's uplink balance, the storms' sources and victims,
and every open or past anomaly's tuning hint (which threshold, on which switch, which
way), most costly first. Markdown (plots as PNG files beside it) and one self-contained
HTML file, because network engineers would rather look than read.

The numbers come from `models.fabric_summary` (the detectors' counter semantics); the
hints are the detectors' own (`suggested_action`), so the report never says what an
anomaly did not.
"""
from __future__ import annotations

import asyncio
import base64
import html
import io
import statistics
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from fabricwatch.actions.escape import markdown_text
from fabricwatch.models.fabric_summary import FabricSummary, PortTotals
from fabricwatch.models.topology import Topology
from fabricwatch.models.vocabulary import PFC_STORM
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import records_pb2 as rec

TOP_N = 20                  # rows of the per-port tables
TOP_LEAVES_PLOTTED = 6
TOP_SWITCHES_TIMELINE = 5
# A switch that sends pauses but marks this many times fewer packets per pause frame than
# the median pausing switch is flagged in the table (the ecn_pfc_misorder detector decides
# anomalies; the table only points the eye).
MARKS_PER_PAUSE_FLAG_RATIO = 10.0
MIN_PAUSE_FRAMES = 1000     # a switch that sent fewer pause frames has no marks-per-pause figure


REPORT_CSS = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}"
              "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
              "font-size:13px;text-align:left}th{background:#f3f3f3}img{max-width:100%}")


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass
class Section:
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    figures: list[tuple[str, bytes]] = field(default_factory=list)      # (file name, PNG)


@dataclass
class Report:
    title: str
    sections: list[Section]

    def markdown(self, figures_dir: Path | None) -> str:
        out = [f"# {self.title}", ""]
        for s in self.sections:
            out += [f"## {s.title}", ""]
            out += [*s.text, ""] if s.text else []
            for t in s.tables:
                out += ["| " + " | ".join(t.headers) + " |", "|" + "---|" * len(t.headers)]
                # cells hold names and summaries the senders chose: inert, never markup
                out += ["| " + " | ".join(map(markdown_text, row)) + " |" for row in t.rows]
                out.append("")
            for name, png in s.figures:
                if figures_dir is not None:
                    figures_dir.mkdir(parents=True, exist_ok=True)
                    (figures_dir / name).write_bytes(png)
                    out += [f"![{name}]({figures_dir.name}/{name})", ""]
        return "\n".join(out)

    def html(self, css_href: str | None = None) -> str:
        """One page; the style inline, or from ``css_href`` (a page served under a CSP without inline styles)."""
        esc = html.escape
        style = f"<link rel='stylesheet' href='{esc(css_href)}'>" if css_href else f"<style>{REPORT_CSS}</style>"
        out = ["<!doctype html><html><head><meta charset='utf-8'>", f"<title>{esc(self.title)}</title>",
               style, "</head><body>", f"<h1>{esc(self.title)}</h1>"]
        for s in self.sections:
            out.append(f"<h2>{esc(s.title)}</h2>")
            out += [f"<p>{esc(p)}</p>" for p in s.text]
            for t in s.tables:
                out.append("<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in t.headers) + "</tr>")
                out += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in t.rows]
                out.append("</table>")
            for name, png in s.figures:
                out.append(f"<img alt='{esc(name)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
        out.append("</body></html>")
        return "\n".join(out)


# --------------------------------------------------------------------------- inputs
def from_recording(path: str | Path, topology: Topology | None, config=None) -> tuple[FabricSummary, list]:
    """The summary of a recording and the anomaly events its replay gives."""
    from fabricwatch.streams.decode import snapshot_batch
    from fabricwatch.streams.pipeline import DetectionPipeline
    from fabricwatch.recording import read_snapshots
    from fabricwatch.streams.replay import accepted_in_order, replay

    stats: Counter = Counter()
    with open(path, "rb") as fh:
        snaps = accepted_in_order(read_snapshots(fh, stats), stats)
    summary = FabricSummary(topology)
    for snap in snaps:
        if snap.blocks:
            summary.add(snapshot_batch(snap))
    pipeline = DetectionPipeline(config, topology) if config is not None else DetectionPipeline(topology=topology)
    return summary, replay(snaps, pipeline).events


async def from_kafka(bootstrap: str, from_unix_s: float, to_unix_s: float,
                     topology: Topology | None) -> tuple[FabricSummary, list]:
    """The summary of the telemetry topic's records received in [from, to) and the anomalies of then."""
    from fabricwatch.streams import topics
    from fabricwatch.streams.decode import to_batch
    from fabricwatch.streams.history import KafkaHistory

    history = KafkaHistory(bootstrap)
    summary, events = FabricSummary(topology), []
    try:
        for topic in (topics.TELEMETRY, topics.ANOMALIES):
            for partition in await topics.partitions_of(bootstrap, topic):
                start = await history.offset_at(topic, partition, int(from_unix_s * 1000))
                if start is None:
                    continue
                end = await history.offset_at(topic, partition, int(to_unix_s * 1000))
                end = end if end is not None else await history.end_offset(topic, partition)
                async for _, value in history.read(topic, partition, start, end):
                    try:
                        if topic == topics.TELEMETRY:
                            summary.add(to_batch(rec.SourceRecord.FromString(value)))
                        else:
                            events.append(ev.AnomalyEvent.FromString(value))
                    except Exception:        # a malformed record says nothing about the fabric
                        continue
    finally:
        await history.close()
    return summary, events


# --------------------------------------------------------------------------- the report
def build(summary: FabricSummary, events: Iterable[ev.AnomalyEvent], title: str = "") -> Report:
    latest: dict[str, ev.AnomalyEvent] = {}
    opened: dict[str, ev.AnomalyEvent] = {}
    for e in events:
        latest[e.dedup_key] = e
        if e.lifecycle == ev.LIFECYCLE_OPEN:
            opened.setdefault(e.dedup_key, e)
    window = (f"{_when(summary.first_ns)} to {_when(summary.last_ns)} ({summary.seconds:.0f} s)"
              if summary.first_ns is not None else "no telemetry")
    kinds = Counter(e.kind for e in latest.values())
    switches, nodes = summary.by_source("switch"), summary.by_source("node")
    overview = Section("Overview", [
        f"Window: {window}. Sources: {len(nodes)} nodes, {len(switches)} switches, {len(summary.ports)} ports.",
        "Anomalies: " + (", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "none") + "."])
    return Report(title or f"Fabric report, {window}", [
        overview, _hints(latest, opened), _storms(latest, opened), _switch_section(summary, switches),
        _uplink_section(summary), _nic_section(summary), _drops_section(summary), _timeline_section(summary)])


def _hints(latest, opened) -> Section:
    rows = []
    for _key, e in sorted(latest.items(), key=lambda kv: -kv[1].impact_gpu_hours):
        if not e.suggested_action:
            continue
        state = "open" if e.lifecycle != ev.LIFECYCLE_RESOLVED else "resolved"
        rows.append([e.kind, _entity(e.entity), state, e.suggested_action, e.probable_cause or e.summary[:160],
                     f"{e.impact_gpu_hours:.2f}"])
    section = Section("Tuning hints", ["From the anomalies of the window, most GPU-hours lost first."])
    if rows:
        section.tables.append(Table(["kind", "where", "state", "hint", "why", "GPU-hours"], rows))
    else:
        section.text.append("No anomaly with a hint in this window.")
    return section


def _storms(latest, opened) -> Section:
    rows = []
    for key, e in latest.items():
        if e.kind != PFC_STORM:
            continue
        first = opened.get(key, e)
        end_ns = e.detected_unix_ns if e.lifecycle == ev.LIFECYCLE_RESOLVED else 0
        victims = sorted(_entity(r) for r in e.related)
        rows.append([_entity(e.entity), f"{len(victims)}", ", ".join(victims[:5]) + (" ..." if len(victims) > 5 else ""),
                     f"{(end_ns - first.onset_unix_ns) / 1e9:.1f}" if end_ns else "open",
                     f"{e.impact_gpu_hours:.2f}"])
    rows.sort(key=lambda r: -float(r[4]))
    section = Section("PFC storms: sources and victims")
    if rows:
        section.tables.append(Table(["source", "victim ports", "victims", "duration s", "GPU-hours"], rows[:TOP_N]))
    else:
        section.text.append("No PFC storm in this window.")
    return section


def _switch_section(summary: FabricSummary, switches: dict[tuple[str, str], PortTotals]) -> Section:
    section = Section("Switches: PFC pauses against ECN marks", [
        "DCQCN needs a congested queue to ECN-mark before it pauses (the marking threshold below PFC XOFF): "
        "a switch that pauses with few marks per pause frame, where its peers mark first, has its thresholds "
        "the wrong way round (`ecn_pfc_misorder`)."])
    ratios = {k: t["ecn_marked"] / t["pause_tx_frames"] for k, t in switches.items()
              if t["pause_tx_frames"] >= MIN_PAUSE_FRAMES}
    median = statistics.median(ratios.values()) if len(ratios) >= 2 else None
    rows = []
    # pause durations only where the platform polls them (SAI TX_PAUSE_DURATION_US); frames always
    ranked = sorted(switches.items(), key=lambda kv: (-kv[1]["pause_tx_s"], -kv[1]["pause_tx_frames"]))
    for (cluster, switch), t in ranked[:TOP_N]:
        ratio = ratios.get((cluster, switch))
        flag = "marks late" if ratio is not None and median and ratio * MARKS_PER_PAUSE_FLAG_RATIO < median else ""
        rows.append([switch, f"{t['pause_tx_s']:.2f}", f"{t['pause_tx_frames']:.0f}", f"{t['pause_rx_s']:.2f}",
                     f"{t['ecn_marked']:.0f}", "" if ratio is None else f"{ratio:.2f}", f"{t['drops']:.0f}", flag])
    section.tables.append(Table(["switch", "pause sent s", "pause frames sent", "pause received s", "ECN-marked",
                                 "marks per pause frame", "drops", ""], rows))
    if ranked and ranked[0][1]["pause_tx_frames"] > 0:
        section.figures.append(("switch_pause_vs_ecn.png", _switch_plot(ranked[:TOP_N])))
    return section


def _uplink_section(summary: FabricSummary) -> Section:
    balance = summary.uplink_balance()
    section = Section("Leaf uplink balance (ECMP)", [
        "Bytes each leaf sent up to each spine: a leaf whose uplinks stay unequal under load hashes its flows "
        "unevenly (few large RoCE flows, hash polarization; `ecmp_imbalance`)."])
    if not balance:
        section.text.append("No leaf uplink traffic (a topology file is needed to know the uplinks).")
        return section
    section.tables.append(Table(["leaf", "uplinks", "max / mean", "coefficient of variation", "mean utilisation"], [
        [b.leaf, str(len(b.tx_bytes)), f"{b.max_over_mean:.2f}", f"{b.coefficient_of_variation:.2f}",
         f"{100 * b.mean_utilisation:.1f} %"] for b in balance[:TOP_N]]))
    section.figures.append(("uplink_balance.png", _uplink_plot(balance[:TOP_LEAVES_PLOTTED])))
    return section


def _nic_section(summary: FabricSummary) -> Section:
    nics = [(k, t) for k, t in summary.ports.items() if summary.kinds.get(k[:2]) == "node"]
    nics.sort(key=lambda kv: -(kv[1]["pause_rx_s"] + kv[1]["cnp_sent"]))
    rows = [[f"{source} {port}", f"{t['pause_rx_s']:.2f}", f"{t['pause_tx_s']:.2f}", f"{t['ecn_marked']:.0f}",
             f"{t['cnp_sent']:.0f}", f"{t['cnp_handled']:.0f}", f"{t['drops']:.0f}"]
            for (_, source, port), t in nics[:TOP_N]]
    section = Section("NICs: pauses and congestion notification", [
        "Receivers send CNPs for ECN-marked packets, senders slow down when they handle them (DCQCN); "
        "a NIC paused for long without CNPs is held by PFC alone."])
    section.tables.append(Table(["NIC port", "paused s", "pause sent s", "ECN-marked received", "CNP sent",
                                 "CNP handled", "drops"], rows))
    return section


def _drops_section(summary: FabricSummary) -> Section:
    ranked = sorted(((k, t) for k, t in summary.ports.items() if t["drops"] > 0), key=lambda kv: -kv[1]["drops"])
    section = Section("Drops", ["Discarded or dropped packets per port (lossless priorities should show none: "
                                "`lossless_drop` decides which matter)."])
    if ranked:
        section.tables.append(Table(["source", "port", "drops", "pause received s"], [
            [source, port, f"{t['drops']:.0f}", f"{t['pause_rx_s']:.2f}"] for (_, source, port), t in ranked[:TOP_N]]))
    else:
        section.text.append("No drops.")
    return section


def _timeline_section(summary: FabricSummary) -> Section:
    section = Section("When the switches paused")
    lines = sorted(summary.pause_timeline.items(), key=lambda kv: -sum(kv[1].values()))[:TOP_SWITCHES_TIMELINE]
    if lines:
        section.figures.append(("pause_timeline.png", _timeline_plot(lines)))
    else:
        section.text.append("No switch sent a pause.")
    return section


# --------------------------------------------------------------------------- plots
def _figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(width, height))


def _png(plt, fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _switch_plot(ranked) -> bytes:
    plt, fig, ax = _figure(10, 0.35 * len(ranked) + 1.5)
    names = [switch for (_, switch), _ in ranked][::-1]
    ax.barh(names, [t["pause_tx_frames"] for _, t in ranked][::-1], color="#d62728", label="pause frames sent")
    ax.set_xlabel("pause frames sent")
    twin = ax.twiny()
    twin.plot([t["ecn_marked"] for _, t in ranked][::-1], names, "o", color="#1f77b4", label="ECN-marked packets")
    twin.set_xlabel("ECN-marked packets")
    fig.legend(loc="lower right")
    return _png(plt, fig)


def _uplink_plot(balance) -> bytes:
    plt, fig, ax = _figure(10, 3.5)
    x = 0
    for b in balance:
        ports = sorted(b.tx_bytes)
        ax.bar(range(x, x + len(ports)), [b.tx_bytes[p] / 1e9 for p in ports], label=b.leaf)
        x += len(ports) + 1
    ax.set_ylabel("GB sent up")
    ax.set_xticks([])
    ax.legend(fontsize=8)
    return _png(plt, fig)


def _timeline_plot(lines) -> bytes:
    plt, fig, ax = _figure(10, 3.2)
    t0 = min(min(line) for _, line in lines)
    for switch, line in lines:
        seconds = sorted(line)
        ax.plot([s - t0 for s in seconds], [line[s] for s in seconds], label=switch)
    ax.set_xlabel("seconds into the window")
    ax.set_ylabel("pause frames sent per s")
    ax.legend(fontsize=8)
    return _png(plt, fig)


def _entity(e: ev.EntityPath) -> str:
    return " ".join(x for x in (e.node, e.switch, e.device, e.port, f"job {e.job}" if e.job else "",
                                f"rank {e.rank}" if e.rank else "") if x)


def _when(t_ns: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t_ns / 1e9)) + " UTC" if t_ns else "-"


def write(report: Report, markdown_path: str | Path | None, html_path: str | Path | None) -> None:
    if markdown_path:
        md = Path(markdown_path)
        md.write_text(report.markdown(md.with_name(md.stem + "_files")), encoding="utf-8")
    if html_path:
        Path(html_path).write_text(report.html(), encoding="utf-8")


def run_from_kafka(bootstrap: str, from_unix_s: float, to_unix_s: float, topology: Topology | None):
    return asyncio.run(from_kafka(bootstrap, from_unix_s, to_unix_s, topology))
