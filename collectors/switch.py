"""`fabricwatch collect-switch`: stream switch port counters over gNMI to the gateway.

    fabricwatch collect-switch --config switches.yaml [--record out.jsonl] [--duration S] [--check]

The configuration (YAML; reference in docs/collectors-switch.md, example in
deploy/switch-collector.example.yaml, schema in `.switch_config`) lists the switches,
each with its gNMI target, profile, TLS and credentials file, and the ingest gateway to
send to.

This module imports only the config schema (pydantic, which the CLI loads anyway for the
policy), so the CLI can register the subcommand cheaply; the gRPC/gNMI machinery is
imported when the command runs.
"""
from __future__ import annotations

import argparse
import logging
import sys

from .switch_config import CollectorConfig, load_config, parse_config

__all__ = ["CollectorConfig", "add_parser", "collect", "describe", "load_config", "parse_config", "run_command"]

log = logging.getLogger("fabricwatch.switch")
# SwitchCollector.stats keys mirrored into fabricwatch_collector_field_errors_total{kind}.
FIELD_ERROR_STATS = {"unmapped_leaves": "unmapped_leaf", "bad_values": "bad_value", "unknown_oid": "unknown_oid"}
METRICS_SYNC_S = 1.0

# --------------------------------------------------------------------------- command line
def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``collect-switch`` on the `fabricwatch` subparsers."""
    sp = subparsers.add_parser("collect-switch", help="stream switch port counters (gNMI) to the gateway",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--config", required=True, help="switch collector YAML (docs/collectors-switch.md)")
    sp.add_argument("--record", help="also write every snapshot to this JSON Lines file")
    sp.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0 = until signalled)")
    sp.add_argument("--check", action="store_true",
                    help="validate the configuration, print the subscriptions, and exit")
    sp.set_defaults(func=run_command)
    return sp


def describe(config: CollectorConfig) -> str:
    from .gnmi_profiles import compile_profile
    from .gnmi_switch import subscribe_request

    lines = []
    gw = config.gateway
    lines.append(f"gateway: {gw.target} ({'TLS' if gw.ca_cert else 'plaintext'}, token {'set' if gw.token else 'none'})"
                 if gw else "gateway: none (--record only)")
    for s in config.switches:
        profile = compile_profile(s.profile)
        tls = ("plaintext" if s.tls.plaintext else "TLS skip-verify" if s.tls.skip_verify
               else "TLS" + (" mTLS" if s.tls.client_cert else ""))
        lines.append(f"switch {s.name} {s.target} profile={s.profile} {tls} auth={s.auth or profile.auth}"
                     f"{'' if s.username else ' (no credentials)'} interval={s.sample_interval_ms}ms "
                     f"priorities={','.join(map(str, s.priorities))}")
        for group in profile.groups:
            req = subscribe_request(group, s, profile)
            lines.append(f"  group {group.name}{' (optional)' if group.optional else ''}"
                         f"{' target=' + group.target if group.target else ''}: "
                         f"{len(req.subscribe.subscription)} paths")
    return "\n".join(lines)


def run_command(args) -> int:
    config = load_config(args.config)
    if args.check:
        print(describe(config))
        return 0
    if config.gateway is None and not args.record:
        print("fabricwatch collect-switch: nothing to send to: configure `gateway:` or pass --record",
              file=sys.stderr)
        return 2
    import asyncio

    stats = asyncio.run(collect(config, record_path=args.record, duration_s=args.duration))
    print(" ".join(f"{k}={v}" for k, v in sorted(stats.items())), file=sys.stderr)
    return 0


async def collect(config: CollectorConfig, *, record_path: str | None = None, duration_s: float = 0.0,
                  stop=None):
    """Run every switch until `stop` (or SIGINT/SIGTERM, or `duration_s`); returns the stats."""
    import asyncio
    import signal
    from collections import Counter

    from fabricwatch.recording import snapshot_to_json

    from .gnmi_switch import run_switches
    from .sender import GatewaySender, SenderConfig

    from fabricwatch import metrics

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):   # not the main thread / platform
            pass
    timer = loop.call_later(duration_s, stop.set) if duration_s else None
    sender = sender_task = None
    sender_stop = asyncio.Event()
    if config.gateway:
        gw = config.gateway
        sender = GatewaySender(SenderConfig(target=gw.target, token=gw.token, root_cert_path=gw.ca_cert,
                                            client_cert_path=gw.client_cert, client_key_path=gw.client_key,
                                            server_name_override=gw.server_name))
        sender_task = asyncio.create_task(sender.run(sender_stop))
    record = open(record_path, "w", encoding="utf-8") if record_path else None
    stats: Counter[str] = Counter()
    samples = metrics.COLLECTOR_SAMPLES.labels("gnmi")

    def emit(snapshot) -> None:
        stats["snapshots"] += 1
        samples.inc()
        if sender:
            sender.submit(snapshot)
        if record:
            record.write(snapshot_to_json(snapshot) + "\n")

    collectors: list = []

    async def export_stats() -> None:
        # The collectors count per switch in plain Counters; mirror their sums once a second.
        field_errors = metrics.CounterMirror(metrics.COLLECTOR_FIELD_ERRORS, rename=FIELD_ERROR_STATS)
        reconnects = metrics.CounterMirror(metrics.COLLECTOR_RECONNECTS, rename={"reconnects": "switch"})
        while True:
            total: Counter[str] = Counter()
            for c in collectors:
                total.update(c.stats)
            field_errors.sync(total)
            reconnects.sync(total)
            await asyncio.sleep(METRICS_SYNC_S)

    exporter = asyncio.create_task(export_stats())
    try:
        await run_switches(list(config.switches), emit, stop, cluster=config.cluster, collectors=collectors)
        if sender:
            stats["drained"] = int(await sender.drain(timeout_s=10))
    finally:
        exporter.cancel()
        for sig in handled:
            loop.remove_signal_handler(sig)
        if timer:
            timer.cancel()
        sender_stop.set()
        if sender_task:
            await sender_task
            stats.update({f"sender_{k}": v for k, v in sender.stats.items()})
        if record:
            record.close()
        for c in collectors:
            for k in ("ticks", "reconnects", "stream_errors", "unmapped_leaves", "bad_values"):
                if c.stats[k]:
                    stats[f"{k}"] += c.stats[k]
    return stats
