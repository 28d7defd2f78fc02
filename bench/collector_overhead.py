"""CPU cost of the node collector on an 8-NIC, 8-GPU node: % of one core.

    python bench/collector_overhead.py [--duration 60] [--repeats 3] [--no-gpus | --real-nvml] [--no-gateway]
                                       [--reference DIR]

A child process runs the real `NodeCollector` loop at the default intervals (PFC counters
every 100 ms, sysfs / other ethtool counters / NVML every 1 s) over the recorded ConnectX-7
RoCE tree (tests/fixtures/sysfs/roce_cx7, 8 ports) and streams every snapshot through
`GatewaySender` to a real gRPC gateway (`IngestService`, records discarded) run by this
parent process. The child's own CPU seconds (user + system) over the measured window,
divided by the wall seconds, is the overhead; the first 2 s (start-up, first discovery)
are left out. With ``--repeats N`` the child runs N times and the median is reported.

``--reference DIR`` measures an earlier version in the same run, alternating with the
current one (these machines are noisy; only the ratio is comparable across runs). DIR
holds that version's ``fabricwatch`` package and is put first on the child's
``PYTHONPATH``; make one from a commit with::

    git archive <commit> | tar -x -C /tmp/ref-src && mkdir -p /tmp/ref && cp -r /tmp/ref-src/fabricwatch /tmp/ref/
    for d in collectors simulator streams models actions protos dashboard; do rm -rf /tmp/ref/fabricwatch/$d; \
        cp -r /tmp/ref-src/$d /tmp/ref/fabricwatch/$d; done
    cp protos/v1/*_pb2*.py /tmp/ref/fabricwatch/protos/v1/

What is and is not real here:
* sysfs: real reads (kept descriptors + pread) of a recorded tree on the local disk; on a
  real node each read runs a kernel ``show()`` (the mlx5 hw_counters one may query the
  firmware, at most once per ``lifespan`` = 10 ms).
* ethtool: the recorded ``ethtool -S`` output of a ConnectX-7 (228 statistics) served by
  `RecordedSource`; the selection is the same code as for the ioctl. The ioctl path of a
  PFC read (GSSET_INFO + GSTATS + selection) is timed separately on a veth pair in a network
  namespace when run as root (``ethtool_ioctl_us_per_read_veth``, for the reference too);
  on mlx5 each ``ETHTOOL_GSTATS`` also makes the driver query the firmware (PPCNT), time
  the process spends asleep rather than on the CPU.
* NVML: 8 GPUs x 18 NVLink links through a stand-in module that answers at once
  (``--no-gpus``: NVML absent), so this measures the Python side only; the result counts
  the NVML calls per second by function (``nvml_calls_per_s``), which times the per-call
  costs measured on a real GPU gives the driver's share; the real per-call
  cost comes from ``python -m fabricwatch.collectors.gpu_check`` on the target machine, or
  from ``--real-nvml``: the GPUs of this machine through the real NVML (the result says how
  many; scale the NVML share to 8 GPUs).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from statistics import median
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "tests" / "fixtures" / "sysfs" / "roce_cx7"
ETHTOOL_TXT = ROOT / "tests" / "fixtures" / "ethtool" / "mlx5_cx7.txt"
WARMUP_S = 2.0


def fake_nvml(n_gpus: int = 8, n_links: int = 18) -> SimpleNamespace:
    """A stand-in for the pynvml module: every call answers at once (Python cost only)."""
    import pynvml

    handles = [SimpleNamespace(i=i) for i in range(n_gpus)]
    energy = [0] * n_gpus

    def nvlink_state(h, link):
        if link >= n_links:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 1

    def total_energy(h):
        energy[h.i] += 700_000
        return energy[h.i]

    def field_values(h, ids):
        out = []
        for fid in ids:
            state = isinstance(fid, tuple)
            out.append(SimpleNamespace(nvmlReturn=0, valueType=1 if state else 3,
                                       value=SimpleNamespace(uiVal=1, ullVal=0)))
        return out

    def wait(es, timeout_ms):
        time.sleep(timeout_ms / 1000)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    names = {k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith(("NVML_", "nvmlEventType"))}
    module = SimpleNamespace(
        **names,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: n_gpus,
        nvmlDeviceGetHandleByIndex=lambda i: handles[i],
        nvmlDeviceGetUUID=lambda h: f"GPU-{h.i:08x}-0000-0000-0000-000000000000",
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetPciInfo=lambda h: SimpleNamespace(busId=f"00000000:{0x1B + 16 * h.i:02X}:00.0".encode()),
        nvmlDeviceGetNvLinkState=nvlink_state,
        nvmlDeviceGetNvLinkErrorCounter=lambda h, link, c: 0, nvmlDeviceGetFieldValues=field_values,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=97, memory=40),
        nvmlDeviceGetClockInfo=lambda h, t: 1980, nvmlDeviceGetMaxClockInfo=lambda h, t: 1980,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0, nvmlDeviceGetPowerUsage=lambda h: 650_000,
        nvmlDeviceGetTemperatureV=lambda h, s: 62,
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 5, nvmlDeviceGetGpuMaxPcieLinkGeneration=lambda h: 5,
        nvmlDeviceGetCurrPcieLinkWidth=lambda h: 16, nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetRemappedRows=lambda h: (0, 0, 0, 0), nvmlDeviceGetTotalEccErrors=lambda h, t, c: 0,
        nvmlDeviceGetPcieReplayCounter=lambda h: 0, nvmlDeviceGetTotalEnergyConsumption=total_energy,
        nvmlEventSetCreate=lambda: "es", nvmlDeviceGetSupportedEventTypes=lambda h: 0x8,
        nvmlDeviceRegisterEvents=lambda h, t, es: None, nvmlEventSetWait=wait, nvmlEventSetFree=lambda es: None,
    )
    module.calls = Counter()
    for name, fn in list(vars(module).items()):
        if name.startswith("nvmlDevice") and callable(fn):
            setattr(module, name, _counted(fn, name, module.calls))
    return module


def _counted(fn, name: str, calls: Counter):
    def call(*args):
        calls[name] += 1
        return fn(*args)
    return call


# --------------------------------------------------------------------------- child: the collector
async def child_main(target: str | None, duration_s: float, gpus: str, pfc_s: float = 0.1) -> dict:
    from fabricwatch.collectors.ethtool_stats import EthtoolReader, RecordedSource
    from fabricwatch.collectors.node import NodeCollector
    from fabricwatch.collectors.node_config import NodeConfig
    from fabricwatch.collectors.sender import GatewaySender
    from fabricwatch.collectors.sysfs_nic import NicReader

    config = NodeConfig.from_dict({"node_name": "bench-node", "cluster": "bench", "sysfs_root": str(TREE),
                                   "intervals": {"ethtool_pfc": pfc_s},
                                   "gateway": {"target": target or "127.0.0.1:1"}})
    nic = NicReader(str(TREE))
    ethtool = EthtoolReader(source=RecordedSource({p.netdev: str(ETHTOOL_TXT) for p in nic.discover()}))
    stand_in = None
    if gpus == "stand-in":     # the collector builds its own GpuReader, as deployed, on this module
        stand_in = sys.modules["pynvml"] = fake_nvml()
    collector = NodeCollector(config, nic_reader=nic, ethtool_reader=ethtool,
                              gpu_reader=False if gpus == "none" else None)
    gpu = collector.gpu
    if gpus == "real" and gpu is None:
        raise SystemExit(f"--real-nvml: {collector.nvml_unavailable}")
    sender = GatewaySender(config.sender_config()) if target else None
    stop, sender_stop = asyncio.Event(), asyncio.Event()
    sender_task = asyncio.create_task(sender.run(sender_stop)) if sender else None
    sizes: list[int] = []
    marks: dict = {}

    loop = asyncio.get_running_loop()
    def mark() -> None:
        marks["t"] = time.monotonic()
        marks["cpu"] = resource.getrusage(resource.RUSAGE_SELF)
        marks["snapshots"] = collector.stats["snapshots"]
        marks["nvml"] = Counter(stand_in.calls) if stand_in else Counter()

    loop.call_later(WARMUP_S, mark)
    loop.call_later(WARMUP_S + duration_s, stop.set)
    on_snapshot = (lambda snap: sizes.append(snap.ByteSize())) if len(sizes) < 2000 else None
    await collector.run(stop, sender=sender, on_snapshot=on_snapshot)
    end_t, end_cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    nvml_calls = (Counter(stand_in.calls) - marks["nvml"]) if stand_in else Counter()
    fds = len(nic.files)
    drained = await sender.drain(10) if sender else True
    if sender:
        sender_stop.set()
        await asyncio.wait_for(sender_task, 10)
    collector.close()
    wall = end_t - marks["t"]
    user = end_cpu.ru_utime - marks["cpu"].ru_utime
    system = end_cpu.ru_stime - marks["cpu"].ru_stime
    return {
        "wall_s": round(wall, 2), "cpu_user_s": round(user, 3), "cpu_system_s": round(system, 3),
        "pct_of_one_core": round(100 * (user + system) / wall, 3),
        "snapshots": collector.stats["snapshots"] - marks["snapshots"],
        "snapshots_per_s": round((collector.stats["snapshots"] - marks["snapshots"]) / wall, 2),
        "mean_snapshot_bytes": round(sum(sizes) / max(1, len(sizes))),
        "overruns": {k: v for k, v in collector.stats.items() if k.startswith("overruns")},
        "acked": sender.stats["accepted"] if sender else None, "drained": drained,
        "gpus": len(gpu.gpus) if gpu else 0, "nvml": gpus, "nic_ports": len(nic.ports), "sysfs_fds": fds,
        "max_rss_mb": round(end_cpu.ru_maxrss / 1024, 1),
        "nvml_calls_per_s": {k: round(v / wall, 2) for k, v in sorted(nvml_calls.items())},
        "code": str(Path(sys.modules["fabricwatch"].__file__).parent.parent),
    }


# --------------------------------------------------------------------------- ioctl micro-benchmark
def ioctl_cost_us(code_dir: str = "") -> float | None:
    """µs per PFC-path read (`EthtoolReader.read_columns`: GSSET_INFO + GSTATS + selection) through
    the real SIOCETHTOOL ioctl on a veth (root only); ``code_dir``: the package to time (a reference)."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return None
    ns = f"fwbench{os.getpid()}"
    code = (f"import sys, timeit\nsys.path.insert(0, {code_dir!r}) if {code_dir!r} else None\n"
            "from fabricwatch.collectors.ethtool_stats import EthtoolReader\n"
            "r = EthtoolReader(allow_fast=['peer_ifindex'])\nr.read_columns('fwb0', 'fast')\n"
            "print(min(timeit.repeat(lambda: r.read_columns('fwb0', 'fast'), number=5000, repeat=5)) / 5000 * 1e6)\n")
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        subprocess.run(["ip", "-n", ns, "link", "add", "fwb0", "type", "veth", "peer", "name", "fwb1"],
                       check=True, capture_output=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "fwb0", "up"], check=True, capture_output=True)
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], check=True,
                             capture_output=True, text=True, timeout=60)
        return round(float(out.stdout.strip()), 1)
    except (subprocess.SubprocessError, OSError, ValueError):
        return None
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# --------------------------------------------------------------------------- parent: the gateway
async def parent_main(args) -> dict:
    import grpc

    from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc
    from fabricwatch.streams.gateway import IngestService

    class CountingSink:
        records = 0

        async def write(self, records):
            CountingSink.records += len(records)

    server = None
    target = None
    if not args.no_gateway:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = grpc.aio.server()
        pb_grpc.add_IngestServicer_to_server(IngestService(CountingSink()), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        target = f"127.0.0.1:{port}"
    cmd = [sys.executable, __file__, "--child", "--duration", str(args.duration), "--pfc-interval", str(args.pfc_interval)]
    if target:
        cmd += ["--target", target]
    if args.no_gpus:
        cmd.append("--no-gpus")
    if args.real_nvml:
        cmd.append("--real-nvml")
    runs: dict[str, list[dict]] = {"current": [], "reference": []}
    try:
        for _ in range(args.repeats):
            for which in ("current", "reference") if args.reference else ("current",):
                env = dict(os.environ)
                if which == "reference":
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.reference, env.get("PYTHONPATH")]))
                before = CountingSink.records
                runs[which].append(await run_child(cmd, env))
                runs[which][-1]["gateway_records"] = CountingSink.records - before if server else None
    finally:
        if server:
            await server.stop(0)
    result = dict(runs["current"][len(runs["current"]) // 2])     # a representative run, then the medians
    result["pct_of_one_core"] = median(r["pct_of_one_core"] for r in runs["current"])
    result["pct_per_repeat"] = [r["pct_of_one_core"] for r in runs["current"]]
    if args.reference:
        ref = median(r["pct_of_one_core"] for r in runs["reference"])
        result["reference"] = {"code": runs["reference"][0]["code"], "pct_of_one_core": ref,
                               "pct_per_repeat": [r["pct_of_one_core"] for r in runs["reference"]],
                               "nvml_calls_per_s": runs["reference"][0]["nvml_calls_per_s"]}
        result["ratio_to_reference"] = round(result["pct_of_one_core"] / ref, 3)
    return result


async def run_child(cmd: list[str], env: dict) -> dict:
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env=env)
    out, err = await proc.communicate()
    lines = out.decode().strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the collector process failed (exit {proc.returncode}): {err.decode().strip()[-800:]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds (after a 2 s warm-up)")
    p.add_argument("--no-gpus", action="store_true", help="NVML absent (NIC sources only)")
    p.add_argument("--real-nvml", action="store_true", help="this machine's GPUs through the real NVML")
    p.add_argument("--pfc-interval", type=float, default=0.1, help="intervals.ethtool_pfc in seconds (default 0.1)")
    p.add_argument("--no-gateway", action="store_true", help="do not send (sampling and encoding only)")
    p.add_argument("--repeats", type=int, default=1, help="runs of the child; the median is reported")
    p.add_argument("--reference", default="", help="a directory holding an earlier fabricwatch package: "
                                                   "measured alternately in the same run, with the ratio")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        gpus = "none" if args.no_gpus else "real" if args.real_nvml else "stand-in"
        print(json.dumps(asyncio.run(child_main(args.target, args.duration, gpus, args.pfc_interval))))
        return
    if args.repeats < 1 or args.duration <= 0:
        p.error("--repeats must be >= 1 and --duration > 0")
    if args.reference and not (Path(args.reference) / "fabricwatch" / "__init__.py").is_file():
        p.error(f"--reference {args.reference}: no fabricwatch package there")
    result = asyncio.run(parent_main(args))
    result["ethtool_ioctl_us_per_read_veth"] = ioctl_cost_us()
    if args.reference:
        result["reference"]["ethtool_ioctl_us_per_read_veth"] = ioctl_cost_us(args.reference)
    result["cpu"] = f"{os.cpu_count()} cores, {os.uname().machine}, Python {sys.version.split()[0]}"
    print(json.dumps(result, indent=2))
    gpus = (f"{result['gpus']} GPUs ({'real NVML' if result['nvml'] == 'real' else 'NVML stand-in'})"
            if result["gpus"] else "no GPUs")
    print(f"\ndocs: node collector, {result['nic_ports']} RoCE ports + {gpus}, PFC every {args.pfc_interval * 1000:.0f} ms, "
          f"the rest every 1 s, "
          f"streamed to a loopback gateway: {result['pct_of_one_core']:.2f} % of one core "
          f"(median of {args.repeats}"
          + (f"; {result['ratio_to_reference']:.2f}x the reference's {result['reference']['pct_of_one_core']:.2f} %"
             if args.reference else "") + ") "
          f"({result['snapshots_per_s']} snapshots/s, {result['mean_snapshot_bytes']} B each, "
          f"max RSS {result['max_rss_mb']} MB; {result['cpu']}).")


if __name__ == "__main__":
    main()
