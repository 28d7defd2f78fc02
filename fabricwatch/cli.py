"""The `fabricwatch` command line: one subcommand per process of the system.

    fabricwatch up --simulate          local broker + gateway + worker + simulated cluster
    fabricwatch gateway / worker       the two long-running services
    fabricwatch simulate               a simulated cluster streaming to a gateway
    fabricwatch replay                 the detectors over a recorded stream, offline
    fabricwatch eval                   labelled scenario suites -> docs/evaluation.md (vs baselines)
    fabricwatch tail                   follow the anomalies topic
    fabricwatch status                 how far the workers are behind (lag, caught up)

Every command takes ``--topic-prefix`` (several deployments on one broker) and
``--partitions`` (the stage-1 topics' partitions when they are created; docs/operations.md).
Long-running commands serve Prometheus metrics with ``--metrics-listen [HOST:PORT]``
(fabricwatch/metrics.py; off by default, 127.0.0.1:97xx when given without a value);
``--log-format json`` writes one JSON object per log line (fabricwatch/logging_setup.py).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

DEFAULT_STATE_DIR = Path(os.environ.get("FABRICWATCH_STATE", ".fabricwatch"))
LOOPBACK_PREFIXES = ("127.", "localhost", "[::1]")
# `--metrics-listen` given without an address: one fixed port per kind of process, so that
# deploy/prometheus/prometheus.example.yml can list them (here, not in fabricwatch.metrics,
# whose prometheus_client import costs ~0.25 s that `--help` should not pay).
METRICS_PORTS = {"gateway": 9701, "worker": 9702, "collect": 9703, "collect-switch": 9704, "simulate": 9705, "respond": 9706, "dashboard": 9707, "feed": 9708}


def _load_topology(path: str | None):
    if not path:
        return None
    from fabricwatch.topology_file import load_topology

    return load_topology(path)


def _detection_config(args):
    from fabricwatch.streams.pipeline import detection_config_of

    return detection_config_of(args)


def cmd_gateway(args) -> int:
    from fabricwatch.streams.auth import TokenAuth
    from fabricwatch.streams.gateway import serve

    loopback = args.listen.startswith(LOOPBACK_PREFIXES)
    if not loopback and not (args.tls_cert and args.tls_key):
        print(f"refusing to listen on {args.listen} without TLS: pass --tls-cert/--tls-key "
              "(only loopback may be plaintext)", file=sys.stderr)
        return 2
    if not loopback and not args.tokens:
        print(f"refusing to listen on {args.listen} without --tokens (per-collector tokens)", file=sys.stderr)
        return 2
    auth = TokenAuth.load(args.tokens) if args.tokens else None
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    from fabricwatch.streams.admission import TokenLimits

    limits = TokenLimits(args.max_batches_per_token, args.max_bytes_per_token,
                         max_bytes_in_flight_total=args.max_bytes_in_flight)
    asyncio.run(serve(args.broker, args.listen, tls=tls, client_ca=args.client_ca, auth=auth, cluster=args.cluster,
                      limits=limits))
    return 0


def cmd_worker(args) -> int:
    import dataclasses

    from fabricwatch.streams.app import WorkerSettings
    from fabricwatch.streams.worker import run_worker

    if args.stale_after < 0 or args.checkpoint_interval <= 0 or args.caught_up_lag < 0:
        raise ValueError("--stale-after and --caught-up-lag must be >= 0, --checkpoint-interval > 0")
    settings = WorkerSettings(bootstrap=args.broker, app_id=args.app_id,
                              ready_file=os.environ.get("FABRICWATCH_WORKER_READY_FILE", ""),
                              state_dir=str(args.state_dir) if args.state_dir else "",
                              checkpoint_interval_s=args.checkpoint_interval,
                              checkpoints=not args.no_checkpoints, caught_up_lag=args.caught_up_lag,
                              rebuild_telemetry_lookback_s=args.rebuild_telemetry_lookback,
                              rebuild_pause_states_lookback_s=args.rebuild_pause_states_lookback,
                              rebuild_rank_steps_lookback_s=args.rebuild_rank_steps_lookback)
    detection = dataclasses.replace(_detection_config(args), max_sample_age_s=args.stale_after or None)
    run_worker(settings, detection, _load_topology(args.topology), loglevel=args.log_level,
               log_format=args.log_format)
    return 0


def cmd_status(args) -> int:
    from fabricwatch.streams.status import print_status

    return asyncio.run(print_status(args.broker, args.app_id, args.caught_up_lag, as_json=args.json))


def cmd_simulate(args) -> int:
    from fabricwatch.collectors.run_simulated import SimulationRun, run_simulation
    from fabricwatch.collectors.sender import SenderConfig

    sender = None
    if args.gateway:
        sender = SenderConfig(target=args.gateway, token=args.token or os.environ.get("FABRICWATCH_TOKEN", ""),
                              root_cert_path=args.ca_cert or "", server_name_override="localhost" if args.ca_cert else "")
    run = SimulationRun(nodes=args.nodes, seed=args.seed, interval_s=args.interval, duration_s=args.duration,
                        realtime=not args.as_fast_as_possible, scenario=args.scenario,
                        record_path=args.record, topology_out=args.topology_out, cadence=args.cadence)
    stats = asyncio.run(run_simulation(run, sender))
    print(" ".join(f"{k}={v}" for k, v in sorted(stats.items())), file=sys.stderr)
    return 0


def cmd_replay(args) -> int:
    from fabricwatch.streams.pipeline import DetectionPipeline
    from fabricwatch.streams.replay import replay_file

    pipeline = DetectionPipeline(_detection_config(args), _load_topology(args.topology))
    result = replay_file(args.input, args.output, pipeline)
    print(f"{len(result.events)} anomaly events -> {args.output}; "
          + " ".join(f"{k}={v}" for k, v in sorted(result.stats.items())), file=sys.stderr)
    return 0


def cmd_report(args) -> int:
    from fabricwatch import fabric_report

    topology = _load_topology(args.topology)
    if bool(args.input) == bool(args.broker):
        print("report: give either --input RECORDING or --broker (with --since-s or --from/--to)", file=sys.stderr)
        return 2
    if args.input:
        summary, events = fabric_report.from_recording(args.input, topology, _detection_config(args))
    else:
        to_s = args.to if args.to is not None else time.time()
        from_s = args.from_ if args.from_ is not None else to_s - args.since_s
        summary, events = fabric_report.run_from_kafka(args.broker, from_s, to_s, topology)
    report = fabric_report.build(summary, events)
    fabric_report.write(report, args.out, args.html)
    print(f"fabric report: {len(summary.ports)} ports, {len(events)} anomaly events, {summary.seconds:.0f} s "
          f"-> {', '.join(p for p in (args.out, args.html) if p)}", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    from fabricwatch.evaluation.report import evaluate

    command = "fabricwatch eval" + (f" --out {args.out}" if args.out != "docs/evaluation.md" else "") + (
        " --quick" if args.quick else "") + (
        f" --healthy-node-hours {args.healthy_node_hours:g}" if args.healthy_node_hours is not None else "") + (
        f" --seed {args.seed}" if args.seed else "")
    _, runs = evaluate(args.out, quick=args.quick, jobs=args.jobs, healthy_node_hours=args.healthy_node_hours,
                       seed=args.seed, command=command, progress=not args.no_progress)
    print(f"{len(runs)} scenarios -> {args.out}", file=sys.stderr)
    return 0


def cmd_tail(args) -> int:
    from fabricwatch.console import LiveView, follow_anomalies

    view = LiveView("fabricwatch tail")
    view.tty = False  # one line per event: pipe-friendly

    async def main() -> None:
        stop = asyncio.Event()
        await follow_anomalies(args.broker, view.add, stop, from_beginning=args.from_beginning)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0


def cmd_feed(args) -> int:
    from fabricwatch.streams.auth import TokenAuth
    from fabricwatch.streams.feed import serve_feed

    if bool(args.tls_cert) != bool(args.tls_key):
        print("--tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    auth = TokenAuth.load(args.tokens) if args.tokens else None
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    asyncio.run(serve_feed(args.broker, args.listen, tls=tls, client_ca=args.client_ca, auth=auth,
                           queue_events=args.queue_events, max_replay_s=args.max_replay,
                           max_subscriptions_per_token=args.max_subscriptions_per_token, cluster=args.cluster))
    return 0


def cmd_up(args) -> int:
    from fabricwatch.stack import LocalStack

    return LocalStack(args).run()


def cmd_dashboard(args) -> int:
    from fabricwatch.dashboard.server import DashboardSettings, parse_listen, serve

    host, port = parse_listen(args.listen)
    settings = DashboardSettings(bootstrap=args.broker, host=host, port=port, topology_path=args.topology or "",
                                 cluster=args.cluster, history_points=args.history_points,
                                 telemetry_lookback_s=args.lookback, stale_after_s=args.stale_after,
                                 allowed_hosts=tuple(args.allowed_host or ()))
    asyncio.run(serve(settings))
    return 0


def cmd_kafka(args) -> int:
    from fabricwatch.localkafka import LocalKafka

    kafka = LocalKafka(port=args.port, state_dir=args.state_dir)
    if args.action == "start":
        print(kafka.start())
    elif args.action == "stop":
        kafka.stop()
    else:
        print("running" if kafka.is_running() else "stopped")
    return 0


def _serve_metrics(args) -> None:
    if not getattr(args, "metrics_listen", ""):
        return
    from fabricwatch.metrics import COMMAND_COMPONENTS, start_metrics_server

    endpoint = start_metrics_server(args.metrics_listen, allow_remote=args.metrics_allow_remote,
                                    components=COMMAND_COMPONENTS[args.command])
    logging.getLogger("fabricwatch.metrics").info("metrics on http://%s:%d/metrics", *endpoint,
                                                  extra={"metrics_port": endpoint.port})


def _topic_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topic-prefix", default=None, metavar="PREFIX",
                   help="what every Kafka topic name starts with (default fabricwatch., or FABRICWATCH_TOPIC_PREFIX)")
    p.add_argument("--partitions", type=int, default=None, metavar="N",
                   help="partitions of the telemetry, rank-steps, facts and state topics when they are created "
                        "(default 24; 12 for `up`; or FABRICWATCH_PARTITIONS)")


def _apply_topic_opts(argv: list[str]) -> list[str]:
    """Set the topic environment before anything imports `streams.topics` (it reads it once).

    The options may come before or after the subcommand; the rest of ``argv`` is returned.
    """
    pre = argparse.ArgumentParser(add_help=False)
    _topic_opts(pre)
    known, rest = pre.parse_known_args(argv)
    if known.topic_prefix is not None:
        os.environ["FABRICWATCH_TOPIC_PREFIX"] = known.topic_prefix
    if known.partitions is not None:
        os.environ["FABRICWATCH_PARTITIONS"] = str(known.partitions)
    return rest


def _anomaly_kinds(text: str) -> str:
    """A comma-separated list of `models.vocabulary` kinds: a misspelt one could never be flagged."""
    from fabricwatch.models.vocabulary import ANOMALY_KINDS
    unknown = sorted({k for k in text.split(",") if k} - ANOMALY_KINDS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown anomaly kind {', '.join(unknown)}; known: "
                                         f"{', '.join(sorted(ANOMALY_KINDS))}")
    return text


def build_parser() -> argparse.ArgumentParser:
    # per-token bounds: plain constants, no heavy imports
    from fabricwatch.streams.admission import (MAX_BYTES_IN_FLIGHT_PER_TOKEN, MAX_BYTES_IN_FLIGHT_TOTAL,
                                               MAX_CONCURRENT_BATCHES_PER_TOKEN, MAX_SUBSCRIPTIONS_PER_TOKEN)

    p = argparse.ArgumentParser(prog="fabricwatch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _topic_opts(p)
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="log lines as text (default) or one JSON object per line")
    sub = p.add_subparsers(dest="command", required=True)

    def metrics_opts(sp, command):
        default = f"127.0.0.1:{METRICS_PORTS[command]}"
        sp.add_argument("--metrics-listen", nargs="?", const=default, default="", metavar="HOST:PORT",
                        help=f"serve Prometheus /metrics here (given alone: {default}; default: off)")
        sp.add_argument("--metrics-allow-remote", action="store_true",
                        help="allow --metrics-listen on a non-loopback address (unauthenticated endpoint)")

    def detection_opts(sp):
        sp.add_argument("--topology", help="topology YAML (docs/topology.md); default: fleet consensus")
        sp.add_argument("--default-nic-rate", default="400 Gb/sec (4X NDR)",
                        help="nominal sysfs rate of NIC ports absent from the topology")
        sp.add_argument("--pfc-detection-ms", type=int, default=200,
                        help="PFC storm detection time T_detect, 100..5000 ms (SONiC pfcwd default 200)")
        sp.add_argument("--pfc-restoration-ms", type=int, default=None,
                        help="PFC storm restoration time, 100..60000 ms (default 2 x detection)")
        sp.add_argument("--collector-linger", type=float, default=2.0, metavar="SECONDS",
                        help="the longest the node collectors hold ticks (their gateway.linger_s, 0..10): "
                             "storms are judged without waiting for it (a pausing port is sent at once)")

    sp = sub.add_parser("up", help="run the local stack and show anomalies live")
    sp.add_argument("--broker", help="use this Kafka (host:port) instead of starting the embedded one")
    sp.add_argument("--simulate", action="store_true", help="also run a simulated cluster with injected faults")
    sp.add_argument("--nodes", type=int, default=64)
    sp.add_argument("--duration", type=float, default=0, help="stop after this many seconds (0 = until Ctrl-C)")
    sp.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    sp.add_argument("--kafka-port", type=int, default=9092)
    sp.add_argument("--gateway-listen", default="127.0.0.1:50051")
    sp.add_argument("--seed", type=int, default=7)
    sp.add_argument("--expect", default="", type=_anomaly_kinds,
                    help="comma-separated anomaly kinds; exit 1 unless all were flagged")
    detection_opts(sp)
    sp.add_argument("--dashboard-listen", default="127.0.0.1:8080", help="where `up` serves the web dashboard (loopback)")
    sp.add_argument("--policy", default=None, help="response policy for the responder (default: deploy/policy.example.yaml, shadow)")
    sp.add_argument("--feed-listen", default="127.0.0.1:50071", help="where `up` serves the gRPC event feed (loopback)")
    sp.set_defaults(func=cmd_up)

    sp = sub.add_parser("gateway", help="gRPC ingest gateway -> Kafka")
    sp.add_argument("--broker", default="127.0.0.1:9092")
    sp.add_argument("--listen", default="127.0.0.1:50051")
    sp.add_argument("--tls-cert")
    sp.add_argument("--tls-key")
    sp.add_argument("--client-ca", help="require client certificates signed by this CA (mTLS)")
    sp.add_argument("--tokens", help="collector tokens file (YAML, see streams/auth.py)")
    sp.add_argument("--cluster", default="",
                    help="cluster stamped on every snapshot of a token without `cluster:` (the payload's is ignored)")
    sp.add_argument("--max-batches-per-token", type=int, default=MAX_CONCURRENT_BATCHES_PER_TOKEN,
                    help="batches one token may have in validation/writing at once (RESOURCE_EXHAUSTED beyond)")
    sp.add_argument("--max-bytes-per-token", type=int, default=MAX_BYTES_IN_FLIGHT_PER_TOKEN,
                    help="bytes of batches one token may have in flight at once (RESOURCE_EXHAUSTED beyond; "
                         "a batch costs ~9x its size in memory while it is written)")
    sp.add_argument("--max-bytes-in-flight", type=int, default=MAX_BYTES_IN_FLIGHT_TOTAL,
                    help="bytes of batches all tokens together may have in flight (one token alone always passes)")
    metrics_opts(sp, "gateway")
    sp.set_defaults(func=cmd_gateway)

    sp = sub.add_parser("worker", help="Faust worker: telemetry -> detectors -> anomalies")
    sp.add_argument("--broker", default="127.0.0.1:9092")
    sp.add_argument("--app-id", default="fabricwatch-worker", help="consumer group; workers sharing it share partitions")
    sp.add_argument("--state-dir", type=Path, default=None, help="Faust's data folder (default: a temporary one)")
    sp.add_argument("--checkpoint-interval", type=float, default=30.0,
                    help="seconds between checkpoints of every partition's state to the state topic")
    sp.add_argument("--no-checkpoints", action="store_true",
                    help="no checkpoints: a moved partition is rebuilt from its history (benchmarks)")
    sp.add_argument("--stale-after", type=float, default=120.0, metavar="SECONDS",
                    help="findings on records the gateway received longer ago go out as info, marked stale, "
                         "and are re-raised once live records confirm them; 0 = off")
    sp.add_argument("--caught-up-lag", type=int, default=500, metavar="RECORDS",
                    help="a partition this close to its end counts as caught up (metric, `fabricwatch status`)")
    for topic, default in (("telemetry", 15.0), ("pause-states", 600.0), ("rank-steps", 300.0)):
        sp.add_argument(f"--rebuild-{topic}-lookback", type=float, default=default, metavar="SECONDS",
                        help=f"on taking over a {topic} partition with no state for it, rebuild the state from "
                             f"this many seconds of its history (findings suppressed); 0 = off")
    detection_opts(sp)
    metrics_opts(sp, "worker")
    sp.set_defaults(func=cmd_worker)

    sp = sub.add_parser("simulate", help="stream a simulated cluster to a gateway (or record it)")
    sp.add_argument("--gateway", help="host:port of the gateway; omit to only --record")
    sp.add_argument("--token", help="collector token (or env FABRICWATCH_TOKEN)")
    sp.add_argument("--ca-cert", help="PEM of the gateway's certificate/CA (TLS)")
    sp.add_argument("--nodes", type=int, default=64)
    sp.add_argument("--seed", type=int, default=7)
    sp.add_argument("--interval", type=float, default=1.0,
                    help="sampling interval in seconds (--cadence uniform only)")
    sp.add_argument("--cadence", default="collector", choices=["collector", "uniform"],
                    help="collector: PFC counters every 100 ms, everything else every 1 s, batched as the "
                         "node collector does (default); uniform: every block every --interval")
    sp.add_argument("--duration", type=float, default=60.0, help="simulated seconds (0 = forever)")
    sp.add_argument("--scenario", default="demo", choices=["demo", "healthy"])
    sp.add_argument("--record", help="also write every snapshot to this recording (binary; JSON Lines if it ends "
                                     "in .jsonl)")
    sp.add_argument("--topology-out", help="write the simulated topology YAML here")
    sp.add_argument("--as-fast-as-possible", action="store_true", help="do not pace ticks to the wall clock")
    metrics_opts(sp, "simulate")
    sp.set_defaults(func=cmd_simulate)

    from fabricwatch.collectors import node_cli as node_collector
    from fabricwatch.collectors import switch as switch_collector

    metrics_opts(node_collector.add_parser(sub), "collect")
    metrics_opts(switch_collector.add_parser(sub), "collect-switch")

    from fabricwatch.streams import respond

    metrics_opts(respond.add_parser(sub), "respond")

    sp = sub.add_parser("replay", help="run the detectors over a recording (binary or JSON Lines)")
    sp.add_argument("--input", required=True)
    sp.add_argument("--output", required=True)
    detection_opts(sp)
    sp.set_defaults(func=cmd_replay)

    sp = sub.add_parser("report", help="fabric report over a window: PFC vs ECN, CNPs, uplink balance, storms, "
                                       "drops, tuning hints (Markdown + HTML)")
    sp.add_argument("--input", help="a recording (binary or JSON Lines), replayed through the detectors")
    sp.add_argument("--broker", help="or read the telemetry and anomalies topics of a time window from Kafka")
    sp.add_argument("--since-s", type=float, default=3600.0, help="with --broker: the last N seconds (default 1 h)")
    sp.add_argument("--from", dest="from_", type=float, help="with --broker: window start, unix seconds")
    sp.add_argument("--to", type=float, help="with --broker: window end, unix seconds (default now)")
    sp.add_argument("--out", default="fabric-report.md", help="Markdown report; plots go to <name>_files/")
    sp.add_argument("--html", default="fabric-report.html", help="self-contained HTML report")
    detection_opts(sp)
    sp.set_defaults(func=cmd_report)

    sp = sub.add_parser("eval", help="score the detectors and two baselines on labelled simulated scenarios")
    sp.add_argument("--out", default="docs/evaluation.md", help="markdown report; plots go to <out without .md>/")
    sp.add_argument("--quick", action="store_true", help="a tiny suite (seconds): a smoke test, not numbers")
    sp.add_argument("--jobs", type=int, default=min(2, len(os.sched_getaffinity(0))),
                    help="scenarios run in this many processes (default: 2, or 1 on one core)")
    sp.add_argument("--healthy-node-hours", type=float, default=None,
                    help="node-hours of healthy runs for the false-alarm rate (default 8)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--no-progress", action="store_true", help="no per-scenario line on stderr")
    sp.set_defaults(func=cmd_eval)

    sp = sub.add_parser("status", help="the workers' progress: lag per topic and partition, caught up or not")
    sp.add_argument("--broker", default="127.0.0.1:9092")
    sp.add_argument("--app-id", default="fabricwatch-worker", help="the workers' consumer group")
    sp.add_argument("--caught-up-lag", type=int, default=500, metavar="RECORDS")
    sp.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("tail", help="follow the anomalies topic")
    sp.add_argument("--broker", default="127.0.0.1:9092")
    sp.add_argument("--from-beginning", action="store_true")
    sp.set_defaults(func=cmd_tail)

    sp = sub.add_parser("feed", help="gRPC event feed for other services: anomalies, actions, audit (CloudEvents)")
    sp.add_argument("--broker", default="127.0.0.1:9092")
    sp.add_argument("--listen", default="127.0.0.1:50071", help="off loopback, --tls-cert/--tls-key and --tokens are required")
    sp.add_argument("--tls-cert")
    sp.add_argument("--tls-key")
    sp.add_argument("--client-ca", help="require client certificates signed by this CA (mTLS)")
    sp.add_argument("--tokens", help="subscriber tokens file (the gateway's format, see streams/auth.py)")
    sp.add_argument("--queue-events", type=int, default=1000,
                    help="events buffered per subscriber; a slower reader loses its oldest ones (counted)")
    sp.add_argument("--max-replay", type=int, default=3600, help="longest replay_seconds a subscriber may ask for")
    sp.add_argument("--max-subscriptions-per-token", type=int, default=MAX_SUBSCRIPTIONS_PER_TOKEN,
                    help="subscriptions one token may hold at once (RESOURCE_EXHAUSTED beyond)")
    sp.add_argument("--cluster", default="",
                    help="cluster a token without `cluster:` may read (default: any); tokens with one read only theirs")
    metrics_opts(sp, "feed")
    sp.set_defaults(func=cmd_feed)

    sp = sub.add_parser("dashboard", help="the live fabric dashboard (web, loopback only)")
    sp.add_argument("--broker", default="127.0.0.1:9092")
    sp.add_argument("--listen", default="127.0.0.1:8080", help="host:port on loopback")
    sp.add_argument("--topology", help="topology YAML (docs/topology.md); default: learnt from the telemetry")
    sp.add_argument("--cluster", default="", help="show only this cluster (default: every record)")
    sp.add_argument("--history-points", type=int, default=120,
                    help="samples kept per NIC port, GPU and switch port (memory: docs in dashboard/state.py)")
    sp.add_argument("--lookback", type=float, default=300.0, help="seconds of telemetry read back at start")
    sp.add_argument("--stale-after", type=float, default=30.0,
                    help="seconds without telemetry after which a node or switch shows as silent")
    sp.add_argument("--allowed-host", action="append", metavar="NAME",
                    help="a Host header name to answer besides the listen host and loopback names (e.g. an "
                         "authenticating proxy's); repeatable. Other Hosts get 421 (DNS rebinding)")
    metrics_opts(sp, "dashboard")
    sp.set_defaults(func=cmd_dashboard)

    sp = sub.add_parser("kafka", help="the embedded local Kafka broker")
    sp.add_argument("action", choices=["start", "stop", "status"])
    sp.add_argument("--port", type=int, default=9092)
    sp.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    sp.set_defaults(func=cmd_kafka)
    return p


def main(argv: list[str] | None = None) -> None:
    from fabricwatch.logging_setup import configure_logging

    argv = _apply_topic_opts(list(argv) if argv is not None else sys.argv[1:])
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        _serve_metrics(args)
        sys.exit(args.func(args))
    except KeyboardInterrupt:
        sys.exit(130)
    except (ValueError, OSError) as exc:
        # Bad configuration (thresholds, topology, tokens, files): a clear message, no traceback.
        if args.log_level.upper() == "DEBUG":
            raise
        print(f"fabricwatch {args.command}: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
