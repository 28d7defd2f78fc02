"""GPUs through NVML (``nvidia-ml-py``, ``import pynvml``): gauges, counters, XID events.

One row per GPU (entity id ``gpu<NVML index>``); the columns and the NVML call behind each are
listed in `nvml_fields`.

NVLink costs: per link and counter, an H100/H200 GPU (18 links) needs 90 NVML calls per
sample; one ``nvmlDeviceGetFieldValues`` call asks the per-link states and the four
totals at once. It is used where it answers every field at the first sample; otherwise
(an older driver, a field the GPU lacks) the reader iterates links from then on.

Per-field intervals: the fields that move rarely and only matter when they move (ECC
totals, remapped rows, the PCIe replay counter, NVLink error totals) are read at the first
sample and then every ``slow_every``-th sample (the node collector's ``nvml.slow_fields_s``,
10 s by default); the rest (utilisation, clocks, clock-event reasons, power, temperature,
PCIe current gen/width, NVLink link states) every sample. Between two slow reads the slow
counters are left out of the row, so the worker takes their rates over the real time
between the reads (its rate state is kept per block layout); the remapped-row gauges carry
their last reading, as the cached maxima do. A slow field that failed for a passing reason
is retried at the next slow read. XIDs stay event-driven.

Degrading, field by field: a call that answers NOT_SUPPORTED or FUNCTION_NOT_FOUND (an
older driver, a GPU without the feature, NVLink on a PCIe card) is logged once, never
called again for that GPU, and its column reads NaN (gauge) or is left out (counter). Any
other NVML error (GPU lost, no permission, ...) is logged once per kind and retried next
sample. Without a driver (``NVMLError_LibraryNotFound``, ``DriverNotLoaded``) or without
``nvidia-ml-py``, `GpuReader.open` returns False with a one-line reason in
``GpuReader.unavailable``; the node collector goes on with its NIC sources.

XID events: ``nvmlEventSetWait`` blocks, so a daemon thread waits on an event set (after
checking ``nvmlDeviceGetSupportedEventTypes`` for ``nvmlEventTypeXidCriticalError``) and
queues every occurrence; `GpuReader.drain_events` hands them to the next snapshot.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .nvml_fields import (
    _FUNCTION_NOT_FOUND,
    _INVALID_ARGUMENT,
    _NO_DRIVER,
    _NOT_SUPPORTED,
    _TIMEOUT,
    COUNTER_NAMES,
    GAUGE_NAMES,
    NAN,
    NVLINK_COUNTERS,
    NVLINK_TOTAL_FIELDS,
    _err_code,
    _err_text,
    _f,
    _field_value,
    _jsonable,
    _put,
    _text,
    normalise_bdf,
)
from .sysfs_nic import EntityRow, Problems

log = logging.getLogger("fabricwatch.collectors.nvml")
MAX_QUEUED_EVENTS = 10_000


class _Missing(Exception):
    """A function the installed nvidia-ml-py does not have (treated as FUNCTION_NOT_FOUND)."""


@dataclass
class GpuEvent:
    """One device event seen by the event thread (becomes a wire ``DeviceEvent``)."""

    entity_id: str
    kind: str
    code: int
    time_unix_ns: int
    detail: str = ""


@dataclass
class _Gpu:
    index: int
    handle: Any
    entity_id: str
    uuid: str = ""
    pci_bdf: str = ""
    name: str = ""
    links: tuple[int, ...] = ()               # NVLink links that answered at start
    static: dict = field(default_factory=dict)   # cached maxima (gauge -> value)
    static_at: float = -1e18                  # time.monotonic() of the last full read of the maxima
    slow: dict = field(default_factory=dict)     # last reading of the slow gauges (remapped rows)
    nvlink_fields: bool | None = None         # None: not tried yet; False: per-link calls instead


def _addr(handle) -> object:
    """A hashable identity of an NVML device handle: its pointer value (else the object's id)."""
    try:
        import ctypes

        return ctypes.cast(handle, ctypes.c_void_p).value
    except Exception:
        return id(handle)


class GpuReader:
    """Samples every GPU NVML sees; one `EntityRow` per GPU per call of `sample`.

    Parameters
    ----------
    nvlink : read NVLink state and error counters (links are found once, at `open`).
    xid_events : run the XID event thread.
    event_wait_ms : the event thread's ``nvmlEventSetWait`` timeout (how fast it stops).
    record_calls : keep the outcome and latency of every NVML call of the last sample in
        ``self.calls`` (``gpu_check`` uses it).
    nvml : the NVML module (default ``pynvml``; tests may pass a stand-in).
    energy : read ``energy_mj``. On an H200 (driver 580.159.04, in a VM) that one call took
        ~2.8 ms of CPU, half of a whole sample: 2.2 % of a core for 8 GPUs at 1 s.
    static_refresh_s : the GPU's own maxima (``sm_clock_max_mhz``, ``pcie_gen_max``,
        ``pcie_width_max``) are read at the first sample and again after this long, not
        every sample (``nvmlDeviceGetMaxClockInfo`` alone took ~2 ms on that H200); the
        last reading is sent every sample.
    slow_every : read the slow fields (ECC, remapped rows, PCIe replay, NVLink error
        totals) at the first sample and every this many samples (1: every sample;
        ``nvmlDeviceGetPcieReplayCounter`` alone took 0.2-0.4 ms on that H200).
    """

    def __init__(self, nvlink: bool = True, xid_events: bool = True, event_wait_ms: int = 1000,
                 record_calls: bool = False, nvml=None, energy: bool = True, static_refresh_s: float = 300.0,
                 slow_every: int = 1) -> None:
        if slow_every < 1:
            raise ValueError(f"slow_every = {slow_every}: must be >= 1")
        self.nvlink = nvlink
        self.slow_every = slow_every
        self.samples = 0                           # calls of sample(): the slow fields' clock
        self.energy = energy
        self.static_refresh_s = static_refresh_s
        self.xid_events = xid_events
        self.event_wait_ms = event_wait_ms
        self.record_calls = record_calls
        self.problems = Problems(log)
        self.unavailable = ""                      # one-line reason when NVML cannot be used
        self.gpus: list[_Gpu] = []
        self.calls: dict[tuple[int, str], dict] = {}
        self.event_status: dict[str, Any] = {}
        self._nvml = nvml
        self._unsupported: dict[tuple, object] = {}     # (gpu, function, column) -> error code
        self._events: deque[GpuEvent] = deque()
        self._event_set = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._opened = False
        self._by_handle: dict[object, _Gpu] = {}

    # -- lifecycle ------------------------------------------------------------------------------
    def open(self) -> bool:
        """Initialise NVML and find the GPUs; False (with ``self.unavailable``) if there is none to read."""
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                self.unavailable = f"nvidia-ml-py is not installed ({exc}); GPU sampling disabled"
                log.warning("%s", self.unavailable)
                return False
            self._nvml = pynvml
        nv = self._nvml
        try:
            nv.nvmlInit()
        except Exception as exc:
            code = _err_code(exc)
            why = _NO_DRIVER.get(code, _err_text(exc))
            self.unavailable = f"NVML unavailable ({why}): no usable NVIDIA driver here; GPU sampling disabled, " \
                               f"NIC sources continue"
            log.warning("%s", self.unavailable)
            return False
        self._opened = True
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception as exc:
            self.unavailable = f"NVML initialised but nvmlDeviceGetCount failed: {_err_text(exc)}"
            log.warning("%s", self.unavailable)
            return False
        for i in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:
                self.problems.report("gpu_unreachable", i, f"gpu{i}: no handle ({_err_text(exc)}); skipped")
                continue
            gpu = _Gpu(i, handle, f"gpu{i}")
            gpu.uuid = _text(self._call(gpu, "uuid", "nvmlDeviceGetUUID", handle)) or ""
            gpu.name = _text(self._call(gpu, "name", "nvmlDeviceGetName", handle)) or ""
            pci = self._call(gpu, "pci_bdf", "nvmlDeviceGetPciInfo", handle)
            gpu.pci_bdf = normalise_bdf(pci.busId) if pci is not None else ""
            if self.nvlink:
                gpu.links = self._find_links(gpu)
            self.gpus.append(gpu)
            self._by_handle[_addr(handle)] = gpu
        if not self.gpus:
            self.unavailable = f"NVML sees {count} GPU(s) but none could be opened"
            log.warning("%s", self.unavailable)
            return False
        log.info("NVML: %d GPU(s): %s", len(self.gpus),
                 ", ".join(f"{g.entity_id}={g.name or '?'}@{g.pci_bdf or '?'}" for g in self.gpus))
        if self.xid_events:
            self._start_events()
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.event_wait_ms / 1000 + 2)
            self._thread = None
        nv = self._nvml
        if self._event_set is not None:
            try:
                nv.nvmlEventSetFree(self._event_set)
            except Exception:
                pass
            self._event_set = None
        if self._opened:
            try:
                nv.nvmlShutdown()
            except Exception:
                pass
            self._opened = False

    # -- calls --------------------------------------------------------------------------------
    def _call(self, gpu: _Gpu, column: str, fn_name: str, *args):
        """One NVML call for one column; None when it failed (reported as the module says).

        ``column`` may carry a ``:<link>`` suffix: NVLink answers are tracked per link.
        """
        key = (gpu.index, fn_name, column)
        if key in self._unsupported:
            return None
        t0 = time.perf_counter()
        try:
            fn = getattr(self._nvml, fn_name, None)
            if fn is None:
                raise _Missing(f"{fn_name} is not in this nvidia-ml-py")
            value = fn(*args)
        except Exception as exc:
            self._failed(gpu, column, fn_name, key, exc, time.perf_counter() - t0)
            return None
        if self.record_calls:
            self.calls[(gpu.index, column)] = {"call": fn_name, "value": _jsonable(value),
                                               "us": round((time.perf_counter() - t0) * 1e6, 1)}
        return value

    def _failed(self, gpu: _Gpu, column: str, fn_name: str, key, exc: BaseException, dt: float) -> None:
        code = "missing" if isinstance(exc, _Missing) else _err_code(exc)
        text = _err_text(exc)
        if self.record_calls:
            self.calls[(gpu.index, column)] = {"call": fn_name, "error": text, "us": round(dt * 1e6, 1)}
        base = column.split(":", 1)[0]          # one report for all links of an NVLink column
        if code in ("missing", _NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
            self._unsupported[key] = code
            self.problems.report("nvml_not_supported", (gpu.index, fn_name, base),
                                 f"{gpu.entity_id}: {fn_name} for {base}: {text}; "
                                 f"{base} {'reads NaN' if base in GAUGE_NAMES else 'is left out'}", logging.INFO)
        elif code is None and not type(exc).__name__.startswith("NVMLError"):
            # a bug or an unexpected binding change: do not hide it, but do not stop sampling
            self.problems.report("nvml_unexpected", (gpu.index, fn_name, type(exc).__name__),
                                 f"{gpu.entity_id}: {fn_name}: unexpected {text}")
        else:
            self.problems.report("nvml_error", (gpu.index, fn_name, code),
                                 f"{gpu.entity_id}: {fn_name}: {text}; retried next sample")

    def _find_links(self, gpu: _Gpu) -> tuple[int, ...]:
        nv = self._nvml
        max_links = getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)
        fn = getattr(nv, "nvmlDeviceGetNvLinkState", None)
        if fn is None:
            return ()
        links = []
        for link in range(max_links):
            try:
                fn(gpu.handle, link)
            except Exception as exc:
                code = _err_code(exc)
                if code in (_NOT_SUPPORTED, _INVALID_ARGUMENT):
                    continue                       # no such link on this GPU
                if code == _FUNCTION_NOT_FOUND:
                    break
                self.problems.report("nvml_error", (gpu.index, "nvlink", link),
                                     f"{gpu.entity_id}: nvmlDeviceGetNvLinkState(link {link}): {_err_text(exc)}")
                continue
            links.append(link)
        if not links:
            self.problems.report("nvml_not_supported", (gpu.index, "nvlink"),
                                 f"{gpu.entity_id}: no NVLink link answers (PCIe-only or not supported); "
                                 f"NVLink columns NaN/absent", logging.INFO)
        return tuple(links)

    # -- sampling -----------------------------------------------------------------------------
    def sample(self) -> list[EntityRow]:
        """One row per GPU; the slow fields only on every ``slow_every``-th call (the first included)."""
        slow = self.samples % self.slow_every == 0
        self.samples += 1
        return [self.sample_gpu(g, slow) for g in self.gpus]

    def sample_gpu(self, gpu: _Gpu, slow: bool = True) -> EntityRow:
        nv, h, call = self._nvml, gpu.handle, self._call
        g: dict[str, float] = dict.fromkeys(GAUGE_NAMES, NAN)
        c: dict[str, int] = {}
        util = call(gpu, "utilization_gpu_pct", "nvmlDeviceGetUtilizationRates", h)
        if util is not None:
            g["utilization_gpu_pct"] = float(util.gpu)
        sm = getattr(nv, "NVML_CLOCK_SM", 1)
        g["sm_clock_mhz"] = _f(call(gpu, "sm_clock_mhz", "nvmlDeviceGetClockInfo", h, sm))
        g.update(self._maxima(gpu))
        g["clocks_event_reasons"] = _f(call(gpu, "clocks_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons", h))
        g["power_mw"] = _f(call(gpu, "power_mw", "nvmlDeviceGetPowerUsage", h))
        g["temperature_c"] = _f(self._temperature(gpu))
        g["pcie_gen_current"] = _f(call(gpu, "pcie_gen_current", "nvmlDeviceGetCurrPcieLinkGeneration", h))
        g["pcie_width_current"] = _f(call(gpu, "pcie_width_current", "nvmlDeviceGetCurrPcieLinkWidth", h))
        if slow:
            self._slow_fields(gpu, c)
        g.update(gpu.slow)
        if self.energy:
            _put(c, "energy_mj", call(gpu, "energy_mj", "nvmlDeviceGetTotalEnergyConsumption", h))
        if gpu.links:
            self._nvlink(gpu, g, c, slow)
        labels = {"uuid": gpu.uuid, "pci_bdf": gpu.pci_bdf, "name": gpu.name}
        return EntityRow(gpu.entity_id, {k: c[k] for k in COUNTER_NAMES if k in c}, g, labels)

    def _slow_fields(self, gpu: _Gpu, c: dict) -> None:
        """ECC totals, PCIe replays (counters, into ``c``) and remapped rows (``gpu.slow``,
        sent with every sample until the next read; NaN after a failed read)."""
        nv, h, call = self._nvml, gpu.handle, self._call
        rows = call(gpu, "remapped_rows", "nvmlDeviceGetRemappedRows", h)
        names = ("remapped_rows_correctable", "remapped_rows_uncorrectable", "remapped_rows_pending",
                 "remapped_rows_failure")
        gpu.slow = dict(zip(names, (float(v) for v in rows[:4]))) if rows is not None else {}
        vol = getattr(nv, "NVML_VOLATILE_ECC", 0)
        for column, etype in (("ecc_corrected_volatile_total", getattr(nv, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)),
                              ("ecc_uncorrected_volatile_total", getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1))):
            _put(c, column, call(gpu, column, "nvmlDeviceGetTotalEccErrors", h, etype, vol))
        _put(c, "pcie_replay_total", call(gpu, "pcie_replay_total", "nvmlDeviceGetPcieReplayCounter", h))

    def _maxima(self, gpu: _Gpu) -> dict[str, float]:
        """The GPU's own maxima: all read again every ``static_refresh_s``; one that failed
        for a passing reason is retried at the next sample."""
        now = time.monotonic()
        full = now - gpu.static_at >= self.static_refresh_s
        h, sm = gpu.handle, getattr(self._nvml, "NVML_CLOCK_SM", 1)
        for column, fn, args in (("sm_clock_max_mhz", "nvmlDeviceGetMaxClockInfo", (h, sm)),
                                 ("pcie_gen_max", "nvmlDeviceGetGpuMaxPcieLinkGeneration", (h,)),
                                 ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth", (h,))):
            if full or (math.isnan(gpu.static.get(column, NAN)) and (gpu.index, fn, column) not in self._unsupported):
                gpu.static[column] = _f(self._call(gpu, column, fn, *args))
        if full:
            gpu.static_at = now
        return gpu.static

    def _temperature(self, gpu: _Gpu):
        """``nvmlDeviceGetTemperatureV``; the deprecated ``nvmlDeviceGetTemperature`` only where V is missing."""
        nv, h = self._nvml, gpu.handle
        sensor = getattr(nv, "NVML_TEMPERATURE_GPU", 0)
        v_key = (gpu.index, "nvmlDeviceGetTemperatureV", "temperature_c")
        value = self._call(gpu, "temperature_c", "nvmlDeviceGetTemperatureV", h, sensor)
        if self._unsupported.get(v_key) not in ("missing", _FUNCTION_NOT_FOUND):
            return value                        # answered, a transient error, or the sensor is not supported
        return self._call(gpu, "temperature_c", "nvmlDeviceGetTemperature", h, sensor)

    def _nvlink(self, gpu: _Gpu, g: dict, c: dict, slow: bool = True) -> None:
        """NVLink states (every sample) and error totals (``slow`` samples only): one
        ``nvmlDeviceGetFieldValues`` call where it answers every field, else one call per
        link and counter (1 x 18 calls per H100/H200 GPU, 5 x 18 on slow samples)."""
        if gpu.nvlink_fields is not False and self._nvlink_by_fields(gpu, g, c, slow):
            return
        nv, h = self._nvml, gpu.handle
        active = 0
        answered = 0
        totals: dict[str, int] = {}
        for link in gpu.links:
            state = self._call(gpu, f"nvlink_state:{link}", "nvmlDeviceGetNvLinkState", h, link)
            if state is not None:
                answered += 1
                active += 1 if state else 0
            for column, const in NVLINK_COUNTERS if slow else ():
                value = self._call(gpu, f"{column}:{link}", "nvmlDeviceGetNvLinkErrorCounter", h, link,
                                   getattr(nv, const))
                if value is not None:
                    totals[column] = totals.get(column, 0) + int(value)
        if answered:
            g["nvlink_links_active"] = float(active)
            g["nvlink_links"] = float(len(gpu.links))
        for column, _ in NVLINK_COUNTERS:
            if column in totals:
                c[column] = totals[column]

    def _nvlink_by_fields(self, gpu: _Gpu, g: dict, c: dict, slow: bool = True) -> bool:
        """Fields ``NVLINK_GET_STATE`` (per link) and, on ``slow`` samples, the four
        ``*_ERROR_COUNT_TOTAL``; False = not usable."""
        nv = self._nvml
        state_id = getattr(nv, "NVML_FI_DEV_NVLINK_GET_STATE", None)
        totals = [(column, getattr(nv, field, None)) for column, field in NVLINK_TOTAL_FIELDS]
        if state_id is None or any(fid is None for _, fid in totals):
            gpu.nvlink_fields = False
            return False
        if not slow and gpu.nvlink_fields is None:
            slow = True                       # the first call asks every field: it decides the method
        if not slow:
            totals = []
        ids = [(state_id, link) for link in gpu.links] + [fid for _, fid in totals]
        values = self._call(gpu, "nvlink_fields", "nvmlDeviceGetFieldValues", gpu.handle, ids)
        if values is None:
            if (gpu.index, "nvmlDeviceGetFieldValues", "nvlink_fields") in self._unsupported:
                gpu.nvlink_fields = False     # the call itself is not there: per-link calls from now on
            return gpu.nvlink_fields is None or gpu.nvlink_fields   # a transient error: columns absent
        failed = [i for i, v in enumerate(values) if v.nvmlReturn != 0]
        if failed:
            if gpu.nvlink_fields is None:     # some field unsupported from the start: per-link calls
                gpu.nvlink_fields = False
                self.problems.report("nvml_not_supported", (gpu.index, "nvlink_fields"),
                                     f"{gpu.entity_id}: NVLink field values incomplete (return codes "
                                     f"{sorted({int(values[i].nvmlReturn) for i in failed})}); "
                                     f"reading NVLink per link instead", logging.INFO)
                return False
            self.problems.report("nvml_error", (gpu.index, "nvlink_fields", "partial"),
                                 f"{gpu.entity_id}: NVLink field values failed for {len(failed)} fields; "
                                 f"retried next sample")
        gpu.nvlink_fields = True
        n = len(gpu.links)
        states = [_field_value(v) for v in values[:n] if v.nvmlReturn == 0]
        if states:
            up = (getattr(nv, "NVML_NVLINK_STATE_ACTIVE", 1), getattr(nv, "NVML_NVLINK_STATE_SLEEP", 2))
            g["nvlink_links_active"] = float(sum(1 for st in states if st in up))
            g["nvlink_links"] = float(n)
        for (column, _), v in zip(totals, values[n:]):
            if v.nvmlReturn == 0:
                _put(c, column, _field_value(v))
        return True

    # -- XID events ---------------------------------------------------------------------------
    def _start_events(self) -> None:
        nv = self._nvml
        xid = getattr(nv, "nvmlEventTypeXidCriticalError", 0x8)
        status: dict[str, Any] = {"registered": [], "not_supported": [], "errors": []}
        self.event_status = status
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except Exception as exc:
            status["errors"].append(f"nvmlEventSetCreate: {_err_text(exc)}")
            self.problems.report("xid_unavailable", "create", f"XID events unavailable: nvmlEventSetCreate: "
                                                              f"{_err_text(exc)}")
            return
        for gpu in self.gpus:
            try:
                supported = nv.nvmlDeviceGetSupportedEventTypes(gpu.handle)
            except Exception as exc:
                status["not_supported"].append(f"{gpu.entity_id}: {_err_text(exc)}")
                continue
            if not supported & xid:
                status["not_supported"].append(f"{gpu.entity_id}: supported event types 0x{supported:x} lack XID")
                continue
            try:
                nv.nvmlDeviceRegisterEvents(gpu.handle, xid, self._event_set)
                status["registered"].append(gpu.entity_id)
            except Exception as exc:
                status["errors"].append(f"{gpu.entity_id}: nvmlDeviceRegisterEvents: {_err_text(exc)}")
        if not status["registered"]:
            self.problems.report("xid_unavailable", "none", "XID events unavailable on every GPU: "
                                 + "; ".join(status["not_supported"] + status["errors"]))
            try:
                nv.nvmlEventSetFree(self._event_set)
            except Exception:
                pass
            self._event_set = None
            return
        self._thread = threading.Thread(target=self._event_loop, name="fabricwatch-nvml-xid", daemon=True)
        self._thread.start()

    def _event_loop(self) -> None:
        nv = self._nvml
        xid = getattr(nv, "nvmlEventTypeXidCriticalError", 0x8)
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait(self._event_set, self.event_wait_ms)
            except Exception as exc:
                if _err_code(exc) == _TIMEOUT:
                    continue
                self.problems.report("xid_wait_error", _err_code(exc), f"nvmlEventSetWait: {_err_text(exc)}")
                self._stop.wait(1.0)           # do not spin on a persistent error
                continue
            if not data.eventType & xid:
                continue
            gpu = self._by_handle.get(_addr(data.device))
            if gpu is None:
                try:
                    index = nv.nvmlDeviceGetIndex(data.device)
                    gpu = next((g for g in self.gpus if g.index == index), None)
                except Exception:
                    gpu = None
            entity = gpu.entity_id if gpu else "gpu?"
            code = int(data.eventData)
            event = GpuEvent(entity, "xid", code, time.time_ns(),
                             f"Xid {code} on {entity} ({gpu.pci_bdf if gpu else 'unknown GPU'})")
            if len(self._events) >= MAX_QUEUED_EVENTS:
                self.problems.counts["xid_events_dropped"] += 1
                continue
            self._events.append(event)
            log.warning("%s", event.detail)

    def drain_events(self) -> list[GpuEvent]:
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    @property
    def events_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

