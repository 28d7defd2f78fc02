"""``fabricwatch collect``: the node collector's command line.

Parses the arguments, loads the config, raises the open-files limit, and runs the
collector once (``--once``, printed or sent) or until signalled, with its `GatewaySender`
(or JSON Lines on stdout with ``--print``), draining the sender at the end. Separate from
the collector: this is process plumbing (signals, asyncio, stdout), the collector is the
sampling.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from . import node
from .node import NodeCollector
from .node_config import NodeConfig, load_config

log = logging.getLogger("fabricwatch.collect")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``fabricwatch collect``: wire it with ``node_cli.add_parser(sub)``; it sets ``func=run_command``."""
    sp = subparsers.add_parser("collect", help="node collector: this node's NICs and GPUs -> gateway",
                               description=node.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--config", required=True, help="collector YAML (deploy/collector.example.yaml)")
    sp.add_argument("--once", action="store_true", help="take one snapshot of every source, then exit")
    sp.add_argument("--print", dest="print_json", action="store_true",
                    help="print snapshots as JSON Lines on stdout instead of sending them")
    sp.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0 = until signalled)")
    sp.set_defaults(func=run_command)
    return sp


def _raise_fd_limit() -> None:
    """Kept sysfs descriptors: let the soft open-files limit rise to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 65536
        if soft != resource.RLIM_INFINITY and soft < min(want, 65536):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, 65536), hard))
    except (ImportError, ValueError, OSError):
        pass


def run_command(args) -> int:
    config = load_config(args.config)
    _raise_fd_limit()
    collector = NodeCollector(config)       # without NVML it logs one line and goes on with the NICs
    try:
        if args.once:
            snap = collector.collect()
            if snap is None:
                print("fabricwatch collect: nothing to read on this node (no RDMA port, no GPU)", file=sys.stderr)
                return 1
            if args.print_json:
                print(snapshot_json(snap))
                _print_problems(collector)
                return 0
            return asyncio.run(_send_once(config, snap))
        return asyncio.run(_run_forever(config, collector, args.print_json, args.duration))
    finally:
        collector.close()


def snapshot_json(snap) -> str:
    from google.protobuf import json_format

    return json_format.MessageToJson(snap, preserving_proto_field_name=True, indent=None)


def _print_problems(collector: NodeCollector) -> None:
    problems = collector.problems()
    if problems:
        print("fabricwatch collect: problems: " + " ".join(f"{k}={v}" for k, v in sorted(problems.items())),
              file=sys.stderr)


async def _send_once(config: NodeConfig, snap) -> int:
    from .sender import GatewaySender

    sender = GatewaySender(config.sender_config())
    stop = asyncio.Event()
    task = asyncio.create_task(sender.run(stop))
    sender.submit(snap)
    ok = await sender.drain(timeout_s=15)
    stop.set()
    try:
        await asyncio.wait_for(task, 10)
    except asyncio.TimeoutError:
        task.cancel()
    print(f"fabricwatch collect: snapshot seq {snap.seq} {'acked' if ok else 'NOT acked'} by {config.gateway.target}",
          file=sys.stderr)
    return 0 if ok else 1


async def _run_forever(config: NodeConfig, collector: NodeCollector, print_json: bool, duration: float) -> int:
    from .sender import GatewaySender

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    if duration > 0:
        loop.call_later(duration, stop.set)
    sender = None if print_json else GatewaySender(config.sender_config())
    sender_stop = asyncio.Event()
    sender_task = asyncio.create_task(sender.run(sender_stop)) if sender else None
    log.info("collecting %s as %r (cluster %r) every %s -> %s", ", ".join(collector.enabled_sources()),
             collector.source, config.cluster, config.intervals, "stdout" if print_json else config.gateway.target)
    out = (lambda snap: print(snapshot_json(snap), flush=False)) if print_json else None
    try:
        await collector.run(stop, sender=sender, on_snapshot=out)
    finally:
        if sender is not None:
            drained = await sender.drain(timeout_s=5)
            if not drained:
                log.warning("stopping with %d snapshots not acked by the gateway", sender.buffered)
            sender_stop.set()
            try:
                await asyncio.wait_for(sender_task, 10)
            except asyncio.TimeoutError:
                sender_task.cancel()
        collector.log_stats(sender)
        sys.stdout.flush()
    return 0
