"""The GPU columns fabricwatch reads through NVML, the call behind each, and NVML's values
as the columns' (the field map of `nvml_gpu.GpuReader`).

One row per GPU (entity id ``gpu<NVML index>``), columns named as docs/schema.md:

========================================  ============================================================  =========
column                                    NVML call                                                     unit
========================================  ============================================================  =========
gauge ``utilization_gpu_pct``             ``nvmlDeviceGetUtilizationRates(h).gpu``                      %
gauge ``sm_clock_mhz`` / ``_max_mhz``     ``nvmlDeviceGetClockInfo`` / ``GetMaxClockInfo(h, SM)``       MHz
gauge ``clocks_event_reasons``            ``nvmlDeviceGetCurrentClocksEventReasons`` (not the           bitmask
                                          deprecated ``...ThrottleReasons``)
gauge ``power_mw``                        ``nvmlDeviceGetPowerUsage``                                   mW
gauge ``temperature_c``                   ``nvmlDeviceGetTemperatureV(h, NVML_TEMPERATURE_GPU)``;       °C
                                          ``nvmlDeviceGetTemperature`` only where V is missing
gauge ``pcie_gen_current`` / ``_max``     ``nvmlDeviceGetCurrPcieLinkGeneration`` /                     gen
                                          ``nvmlDeviceGetGpuMaxPcieLinkGeneration`` (the GPU's own)
gauge ``pcie_width_current`` / ``_max``   ``nvmlDeviceGetCurrPcieLinkWidth`` / ``...MaxPcieLinkWidth``  lanes
gauge ``remapped_rows_*``                 ``nvmlDeviceGetRemappedRows`` -> correctable, uncorrectable,  rows
                                          pending (0/1), failure (0/1)
gauge ``nvlink_links_active``/``_links``  links found at start by ``nvmlDeviceGetNvLinkState``         links
                                          (iterating links, NOT_SUPPORTED = no such link); then
                                          field ``NVLINK_GET_STATE`` per link (see below)
counter ``ecc_{,un}corrected_volatile_    ``nvmlDeviceGetTotalEccErrors(h, CORRECTED/UNCORRECTED,       errors
total``                                   NVML_VOLATILE_ECC)``
counter ``pcie_replay_total``             ``nvmlDeviceGetPcieReplayCounter``                            replays
counter ``energy_mj``                     ``nvmlDeviceGetTotalEnergyConsumption``                       mJ
counter ``nvlink_{crc_flit,crc_data,      fields ``NVML_FI_DEV_NVLINK_{CRC_FLIT,CRC_DATA,REPLAY,        errors
replay,recovery}_errors_total``           RECOVERY}_ERROR_COUNT_TOTAL``; else the sum over links of
                                          ``nvmlDeviceGetNvLinkErrorCounter(h, link, DL_CRC_FLIT /
                                          DL_CRC_DATA / DL_REPLAY / DL_RECOVERY)``
label ``uuid``, ``pci_bdf``, ``name``     ``nvmlDeviceGetUUID``, ``GetPciInfo().busId`` (written as
                                          sysfs does, ``0000:1b:00.0``), ``GetName``
========================================  ============================================================  =========
"""
from __future__ import annotations

from fabricwatch.counters import GPU_GAUGES

NAN = float("nan")

EXTRA_GAUGES = ("remapped_rows_pending", "remapped_rows_failure", "nvlink_links_active", "nvlink_links")
GAUGE_NAMES = tuple(GPU_GAUGES) + EXTRA_GAUGES
COUNTER_NAMES = (
    "ecc_corrected_volatile_total", "ecc_uncorrected_volatile_total", "pcie_replay_total", "energy_mj",
    "nvlink_crc_flit_errors_total", "nvlink_crc_data_errors_total", "nvlink_replay_errors_total",
    "nvlink_recovery_errors_total",
)
# counter column -> NVML_NVLINK_ERROR_DL_* constant name
NVLINK_COUNTERS = (
    ("nvlink_crc_flit_errors_total", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
    ("nvlink_crc_data_errors_total", "NVML_NVLINK_ERROR_DL_CRC_DATA"),
    ("nvlink_replay_errors_total", "NVML_NVLINK_ERROR_DL_REPLAY"),
    ("nvlink_recovery_errors_total", "NVML_NVLINK_ERROR_DL_RECOVERY"),
)
# the same totals as NVML field values (all links summed by the driver)
NVLINK_TOTAL_FIELDS = (
    ("nvlink_crc_flit_errors_total", "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"),
    ("nvlink_crc_data_errors_total", "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"),
    ("nvlink_replay_errors_total", "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"),
    ("nvlink_recovery_errors_total", "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"),
)
# NVML return codes (nvml.h; the same values as pynvml's NVML_ERROR_* constants).
_NOT_SUPPORTED, _INVALID_ARGUMENT, _FUNCTION_NOT_FOUND, _TIMEOUT = 3, 2, 13, 10
_NO_DRIVER = {9: "driver not loaded", 12: "libnvidia-ml.so.1 not found"}   # DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND


def _err_code(exc: BaseException) -> int | None:
    return getattr(exc, "value", None)


def _err_text(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:   # NVMLError.__str__ calls into the library
        return f"{type(exc).__name__} (code {_err_code(exc)})"


def normalise_bdf(bus_id) -> str:
    """NVML's ``00000000:1B:00.0`` as sysfs writes it, ``0000:1b:00.0``.

    >>> normalise_bdf(b"00000000:1B:00.0"), normalise_bdf("0000:c3:00.0")
    ('0000:1b:00.0', '0000:c3:00.0')
    """
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    text = text.strip().lower()
    domain, sep, rest = text.partition(":")
    if sep and len(domain) > 4:
        domain = domain[-4:]
    return f"{domain}{sep}{rest}"


def _field_value(v) -> int | float:
    """The value of one ``c_nvmlFieldValue_t`` by its ``valueType``."""
    member = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")[int(v.valueType)] \
        if 0 <= int(v.valueType) < 7 else "ullVal"
    return getattr(v.value, member)


def _f(value) -> float:
    return NAN if value is None else float(value)


def _put(counters: dict, name: str, value) -> None:
    if value is not None and 0 <= int(value) < 2**64:
        counters[name] = int(value)


def _text(value) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _jsonable(value):
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    fields = getattr(value, "_fields_", None)
    if fields:
        return {name: _jsonable(getattr(value, name)) for name, *_ in fields}
    return repr(value)
