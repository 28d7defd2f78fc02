"""Gateway memory under concurrent large calls from one token (issue #13, docs/security.md).

Starts `fabricwatch gateway` (of the given `--python`, so the same script measures another
checkout) with a tokens file, then makes `--calls` concurrent ``Send`` calls from one token,
each a batch of about `--batch-mib` MiB (snapshots just under Kafka's 1 MB record limit), a
few rounds. Prints the gateway's resident memory before and its peak (VmHWM), and how many
calls were refused (RESOURCE_EXHAUSTED) or answered:

    python3 bench/gateway_memory.py --broker 127.0.0.1:9092 --calls 16 --batch-mib 15
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import free_port  # noqa: E402
from test_gateway_bounds import big_snapshot  # noqa: E402

from fabricwatch.protos.v1 import telemetry_pb2 as pb  # noqa: E402
from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc  # noqa: E402
from fabricwatch.streams.auth import TokenAuth  # noqa: E402

TOKEN = "bench-token-0123456789"


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def batch_of(mib: float, tag: str) -> pb.IngestBatch:
    per_snapshot = 900_000
    count = max(1, int(mib * 1024 * 1024 // per_snapshot))
    return pb.IngestBatch(snapshots=[big_snapshot(f"node-{tag}-{i}", per_snapshot, seq=i) for i in range(count)])


async def round_of_calls(listen: str, calls: int, batch: pb.IngestBatch) -> Counter:
    outcome: Counter = Counter()
    options = [("grpc.max_send_message_length", 32 * 1024 * 1024)]
    async with grpc.aio.insecure_channel(listen, options=options) as channel:
        stub = pb_grpc.IngestStub(channel)

        async def one() -> None:
            try:
                ack = await stub.Send(batch, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=120)
                outcome[f"acked ({ack.accepted} snapshots)"] += 1
            except grpc.aio.AioRpcError as exc:
                outcome[exc.code().name] += 1

        await asyncio.gather(*(one() for _ in range(calls)))
    return outcome


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--broker", default="127.0.0.1:9092")
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--batch-mib", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gateway-arg", action="append", default=[], help="an extra argument for the gateway")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "tokens.yaml"
        TokenAuth.write(tokens, "bench", TOKEN, ["node-*"])
        port = free_port()
        log = open(Path(tmp) / "gateway.log", "wb")
        proc = subprocess.Popen([args.python, "-m", "fabricwatch.cli", "gateway", "--broker", args.broker,
                                 "--listen", f"127.0.0.1:{port}", "--tokens", str(tokens), *args.gateway_arg],
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        try:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit((Path(tmp) / "gateway.log").read_text()[-2000:])
                time.sleep(0.2)
            time.sleep(1.0)
            idle_mb = status_kb(proc.pid, "VmRSS") / 1024
            outcome: Counter = Counter()
            for r in range(args.rounds):
                outcome += asyncio.run(round_of_calls(f"127.0.0.1:{port}", args.calls, batch_of(args.batch_mib, str(r))))
            peak_mb = status_kb(proc.pid, "VmHWM") / 1024
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"gateway ({args.python}): {idle_mb:.0f} MB idle, peak {peak_mb:.0f} MB under {args.rounds} rounds of "
          f"{args.calls} concurrent {args.batch_mib:g} MiB calls from one token; calls: {dict(outcome)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
