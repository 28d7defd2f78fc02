"""Check what the node collector's GPU reader gets from NVML on this machine; print JSON.

    python -m fabricwatch.collectors.gpu_check [--gap 1.0] [--no-nvlink] [--no-events]

The report holds, for every GPU: its name, UUID and PCI address; every column the collector
sends, with the value read or the NVML error it got, the NVML function behind it and how
long the call took; the NVLink links found; two samples ``--gap`` seconds apart and the
counters that moved between them (with the mean power from the energy counter); whether
the XID event set could be registered; the driver and NVML versions; and the cost of one
full sample. ``summary`` says the same in a few lines.

Exit status: 0 if at least one GPU was read, 3 if there is no driver (or no
nvidia-ml-py), 1 if NVML initialised but no GPU could be read.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import socket
import sys
import time

from .nvml_fields import COUNTER_NAMES, GAUGE_NAMES, _err_text, _jsonable
from .nvml_gpu import GpuReader

EXIT_OK, EXIT_NO_GPU, EXIT_NO_DRIVER = 0, 1, 3


def _versions(nv) -> dict:
    out = {}
    for key, fn in (("driver_version", "nvmlSystemGetDriverVersion"), ("nvml_version", "nvmlSystemGetNVMLVersion"),
                    ("cuda_driver_version", "nvmlSystemGetCudaDriverVersion_v2"), ("device_count", "nvmlDeviceGetCount")):
        try:
            out[key] = _jsonable(getattr(nv, fn)())
        except Exception as exc:
            out[key] = {"error": _err_text(exc)}
    return out


def _binding_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-ml-py")
    except Exception:
        return "unknown"


def _clean(value):
    """NaN is not JSON: write null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _row_dict(row) -> dict:
    return {"counters": dict(row.counters), "gauges": {k: _clean(v) for k, v in row.gauges.items()},
            "labels": dict(row.labels)}


def build_report(gap_s: float = 1.0, nvlink: bool = True, events: bool = True, nvml=None) -> tuple[dict, int]:
    report: dict = {
        "tool": "fabricwatch.collectors.gpu_check",
        "host": socket.gethostname(),
        "time_unix_ns": time.time_ns(),
        "python": platform.python_version(),
        "nvidia_ml_py": _binding_version(),
    }
    reader = GpuReader(nvlink=nvlink, xid_events=events, record_calls=True, nvml=nvml)
    opened = reader.open()
    if reader._nvml is not None and reader._opened:
        report["nvml"] = _versions(reader._nvml)
    if not opened:
        report["ok"] = False
        report["error"] = reader.unavailable
        code = EXIT_NO_DRIVER if not reader._opened else EXIT_NO_GPU
        report["summary"] = [reader.unavailable]
        reader.close()
        return report, code
    try:
        t0 = time.perf_counter()
        first = reader.sample()
        cost_s = time.perf_counter() - t0
        calls_first = dict(reader.calls)
        time.sleep(gap_s)
        t1 = time.perf_counter()
        second = reader.sample()
        cost2_s = time.perf_counter() - t1
        gpus = []
        summary = []
        read_any = False
        for gpu, a, b in zip(reader.gpus, first, second):
            fields = {}
            for (index, column), info in sorted(calls_first.items(), key=lambda kv: str(kv[0][1])):
                if index == gpu.index:
                    fields[column] = info
            got = [c for c in list(GAUGE_NAMES) if not math.isnan(a.gauges.get(c, math.nan))]
            got += [c for c in COUNTER_NAMES if c in a.counters]
            missing = [c for c in list(GAUGE_NAMES) + list(COUNTER_NAMES) if c not in got]
            read_any = read_any or bool(got)
            moved = {k: b.counters[k] - a.counters[k] for k in b.counters if k in a.counters
                     and b.counters[k] != a.counters[k]}
            mean_power_w = None
            if "energy_mj" in moved and gap_s > 0:
                mean_power_w = round(moved["energy_mj"] / 1000.0 / gap_s, 1)
            gpus.append({
                "index": gpu.index, "entity_id": gpu.entity_id, "name": gpu.name, "uuid": gpu.uuid,
                "pci_bdf": gpu.pci_bdf, "nvlink_links_found": list(gpu.links),
                "fields": fields,
                "columns_read": got, "columns_not_read": missing,
                "sample_1": _row_dict(a), "sample_2": _row_dict(b),
                "counters_moved": moved, "mean_power_w_from_energy": mean_power_w,
            })
            summary.append(f"{gpu.entity_id} {gpu.name or '?'} ({gpu.pci_bdf or '?'}): {len(got)}/"
                           f"{len(GAUGE_NAMES) + len(COUNTER_NAMES)} columns read"
                           + (f"; not read: {', '.join(missing)}" if missing else ""))
        report["gpus"] = gpus
        report["sample_cost_ms"] = {"first": round(cost_s * 1e3, 2), "second": round(cost2_s * 1e3, 2),
                                    "per_gpu_second": round(cost2_s * 1e3 / max(1, len(reader.gpus)), 2),
                                    "nvml_calls_per_sample": sum(1 for k in calls_first)}
        report["xid_events"] = {"requested": events, "thread_running": reader.events_running,
                                **reader.event_status, "seen": [vars(e) for e in reader.drain_events()]}
        report["problems"] = dict(reader.problems.counts)
        summary.append("XID events: " + (f"registered on {', '.join(reader.event_status.get('registered', []))}"
                                         if reader.events_running else
                                         f"not registered ({'; '.join(reader.event_status.get('not_supported', []) + reader.event_status.get('errors', [])) or 'disabled'})"))
        summary.append(f"one sample of {len(reader.gpus)} GPU(s) cost {cost2_s * 1e3:.2f} ms")
        report["summary"] = summary
        report["ok"] = read_any
        return report, EXIT_OK if read_any else EXIT_NO_GPU
    finally:
        reader.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fabricwatch.collectors.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gap", type=float, default=1.0, help="seconds between the two samples (default 1)")
    p.add_argument("--no-nvlink", action="store_true", help="skip NVLink state and error counters")
    p.add_argument("--no-events", action="store_true", help="do not register the XID event set")
    args = p.parse_args(argv)
    report, code = build_report(args.gap, nvlink=not args.no_nvlink, events=not args.no_events)
    report["exit_status"] = code
    print(json.dumps(report, indent=2, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
