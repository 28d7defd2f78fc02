"""NVIDIA's Xid catalog, as fabricwatch reads it: per code, who is at fault and what to do.

Source: NVIDIA, "Xid Errors" (https://docs.nvidia.com/deploy/xid-errors/), the Xid catalog
for Ampere and newer GPUs ("Analyzing Xid Errors with the Xid Catalog": mnemonic,
description, Resolution Bucket *Immediate Action* / *Investigatory Action*), and the older
"Xid Error Listing" (the causes each Xid can have: hardware, driver, user application, bus,
thermal, frame buffer). The mnemonics are the driver's own (``nverror.h`` in
open-gpu-kernel-modules). This module imports nothing from the project, so the simulator
(its log text) and the detector (what opens an anomaly) use the same table.

Categories (`XidInfo.category`):

* ``application``: a channel or engine exception of one CUDA context (NVIDIA's immediate
  action RESTART_APP or IGNORE; the GPU stays usable): a user bug, an illegal address, a
  bad kernel. Job-level information: the job's owner must act, the GPU is not at fault.
* ``consequence``: XID 45, *preemptive cleanup, due to previous errors*: the driver tears
  down the channels of every context on the node that shared the failing GPU or its job
  (catalog: "Not solo: IGNORE, follow the other Xid"). Alone it is application-level.
* ``hardware``: memory (double-bit / contained / uncontained ECC, row remapping, high
  single-bit rate), the bus, NVLink, the PMU: the GPU itself needs a reset, a drain or an RMA.
* ``firmware``: the GPU's firmware or the driver's hold on it (GSP RPC timeout, GSP error,
  GPU timeout, context-switch timeout): RESET_GPU, update the driver/firmware if it repeats.

Codes not in the table are treated as hardware (`is_gpu_fault` is True): an unknown code
is investigated, never silently dropped.

>>> lookup(79).category, lookup(79).immediate_action, lookup(79).severity
('hardware', 'RESTART_BM', 'critical')
>>> [c for c in (13, 31, 43, 45, 48, 94, 119, 999) if is_gpu_fault(c)]
[48, 94, 119, 999]
>>> lookup(45).category, lookup(999).text
('consequence', 'Unknown Xid')
"""
from __future__ import annotations

from dataclasses import dataclass

# The severities of the shared vocabulary: the one project module this one imports (it imports nothing).
from fabricwatch.models.vocabulary import CRITICAL, INFO, WARNING

APPLICATION, CONSEQUENCE, HARDWARE, FIRMWARE = "application", "consequence", "hardware", "firmware"
CATEGORIES = (APPLICATION, CONSEQUENCE, HARDWARE, FIRMWARE)
# Categories that are a fault of the GPU (open `gpu_xid`); the others are job-level information.
FAULT_CATEGORIES = frozenset({HARDWARE, FIRMWARE})


@dataclass(frozen=True)
class XidInfo:
    code: int
    mnemonic: str            # the driver's name (nverror.h)
    text: str                # the catalog's description, as the driver log prints it
    category: str            # APPLICATION | CONSEQUENCE | HARDWARE | FIRMWARE
    immediate_action: str    # NVIDIA's Resolution Bucket (Immediate Action)
    severity: str            # what an anomaly of this code is: critical / warning / info
    action: str              # what the operator does, in words

    @property
    def is_gpu_fault(self) -> bool:
        return self.category in FAULT_CATEGORIES


_APP_ACTION = "job-level: the application's owner restarts and debugs the job; the GPU is healthy"
_CE_TEXT = "Copy Engine Exception"


def _app(code: int, mnemonic: str, text: str, bucket: str = "RESTART_APP") -> XidInfo:
    return XidInfo(code, mnemonic, text, APPLICATION, bucket, INFO, _APP_ACTION)


CATALOG: dict[int, XidInfo] = {x.code: x for x in (
    # -- application: one context's channel or engine exception -------------------------------
    _app(8, "ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing"),
    _app(11, "ROBUST_CHANNEL_GR_ERROR_MISSING_HW", "Invalid or corrupted push buffer stream"),
    _app(13, "ROBUST_CHANNEL_GR_EXCEPTION", "Graphics Engine Exception"),
    _app(25, "ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY", "Invalid or illegal push buffer stream"),
    _app(31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault"),
    _app(32, "ROBUST_CHANNEL_PBDMA_ERROR", "Invalid or corrupted push buffer stream"),
    _app(37, "ROBUST_CHANNEL_FECS_ERR_UNIMP_FIRMWARE_METHOD", "Driver firmware error", "IGNORE"),
    _app(38, "ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT", "Driver firmware error", "IGNORE"),
    _app(39, "ROBUST_CHANNEL_CE0_ERROR", _CE_TEXT),
    _app(40, "ROBUST_CHANNEL_CE1_ERROR", _CE_TEXT),
    _app(41, "ROBUST_CHANNEL_CE2_ERROR", _CE_TEXT),
    _app(43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "GPU stopped processing", "IGNORE"),
    _app(44, "ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW", "Graphics Engine fault during context switch", "IGNORE"),
    _app(68, "ROBUST_CHANNEL_NVDEC0_ERROR", "NVDEC0 Exception"),
    _app(69, "ROBUST_CHANNEL_GR_CLASS_ERROR", "Graphics Engine class error"),
    _app(80, "PBDMA_PUSHBUFFER_CRC_MISMATCH", "Corrupted data sent to GPU"),
    # -- consequence: the driver cleans up after another Xid ----------------------------------
    XidInfo(45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "Preemptive cleanup, due to previous errors", CONSEQUENCE,
            "WORKFLOW_XID_45", INFO,
            "follow the Xid it cleans up after; alone: job-level (the job was stopped or killed)"),
    # -- hardware --------------------------------------------------------------------------------
    XidInfo(48, "ROBUST_CHANNEL_GPU_ECC_DBE", "Double Bit ECC Error", HARDWARE, "WORKFLOW_XID_48", CRITICAL,
            "drain the node; reset the GPU to remap the failing row"),
    XidInfo(61, "PMU_BREAKPOINT", "Internal micro-controller breakpoint/warning", HARDWARE, "CONTACT_SUPPORT",
            WARNING, "reset the GPU when idle; contact support if it repeats"),
    XidInfo(62, "PMU_HALT_ERROR", "Internal micro-controller halt", HARDWARE, "RESET_GPU", CRITICAL,
            "drain the node and reset the GPU"),
    XidInfo(63, "INFOROM_PAGE_RETIREMENT_EVENT", "ECC page retirement or row remapping recording event", HARDWARE,
            "IGNORE", WARNING, "reset the GPU when idle to activate the remapped row; watch for repeats"),
    XidInfo(64, "INFOROM_PAGE_RETIREMENT_FAILURE", "ECC page retirement or row remapper recording failure",
            HARDWARE, "RESET_GPU", CRITICAL, "drain the node and reset the GPU; RMA if remapping keeps failing"),
    XidInfo(74, "NVLINK_ERROR", "NVLink Error", HARDWARE, "WORKFLOW_NVLINK_ERR", CRITICAL,
            "check NVLink/NVSwitch; drain the node if it repeats"),
    XidInfo(79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "GPU has fallen off the bus", HARDWARE, "RESTART_BM",
            CRITICAL, "drain the node; the GPU fell off the bus (reboot, reseat)"),
    XidInfo(92, "EXCESSIVE_SBE_INTERRUPTS", "High single-bit ECC error rate", HARDWARE, "IGNORE", WARNING,
            "watch the GPU's ECC counters; drain and reset if uncorrectable errors follow"),
    XidInfo(94, "ROBUST_CHANNEL_CONTAINED_ERROR", "Contained ECC error", HARDWARE, "RESTART_APP", CRITICAL,
            "restart the affected job; reset the GPU when idle"),
    XidInfo(95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "Uncontained ECC error", HARDWARE, "RESET_GPU", CRITICAL,
            "drain the node and reset the GPU"),
    XidInfo(136, "ALI_TRAINING_FAIL", "NVLink link training failed", HARDWARE, "RESET_GPU", CRITICAL,
            "reset the GPU; check the NVLink connection if it repeats"),
    XidInfo(140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "Unrecovered ECC error", HARDWARE, "RESET_GPU", CRITICAL,
            "drain the node and reset the GPU"),
    # -- firmware / driver's hold on the GPU ---------------------------------------------------
    XidInfo(46, "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "GPU stopped processing", FIRMWARE, "RESET_GPU", CRITICAL,
            "reset the GPU"),
    XidInfo(109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "Context Switch Timeout Error", FIRMWARE, "RESET_GPU",
            CRITICAL, "reset the GPU"),
    XidInfo(119, "GSP_RPC_TIMEOUT", "GSP RPC Timeout", FIRMWARE, "RESET_GPU", CRITICAL,
            "reset the GPU; update the driver/firmware if it repeats"),
    XidInfo(120, "GSP_ERROR", "GSP Error", FIRMWARE, "RESET_GPU", CRITICAL,
            "reset the GPU; update the driver/firmware if it repeats"),
    XidInfo(143, "GPU_INIT_ERROR", "GPU Initialization Failure", FIRMWARE, "RESET_GPU", CRITICAL,
            "reset the GPU; contact support if it repeats"),
)}

UNKNOWN_ACTION = "look the code up in NVIDIA's Xid catalog; drain the node if it repeats"

# XIDs that come with an uncorrectable ECC error (the volatile DBE counter rises).
UNCORRECTABLE_ECC_XIDS = frozenset({48, 94, 95})
# XIDs after which the GPU can no longer be read (gauges NaN, its job hangs).
GPU_LOST_XIDS = frozenset({79})
# The code a preemptive cleanup reports.
PREEMPTIVE_CLEANUP = 45


def lookup(code: int) -> XidInfo:
    """The catalog entry of ``code``; an unknown code is a hardware fault, warning (investigate)."""
    info = CATALOG.get(code)
    if info is None:
        return XidInfo(code, "", "Unknown Xid", HARDWARE, "CONTACT_SUPPORT", WARNING, UNKNOWN_ACTION)
    return info


def is_gpu_fault(code: int) -> bool:
    """Whether an XID of this code is a fault of the GPU (hardware, firmware or unknown)."""
    return lookup(code).is_gpu_fault


def text(code: int) -> str:
    """The catalog's description of ``code`` ("Unknown Xid" when it has none)."""
    return lookup(code).text


APPLICATION_XIDS = frozenset(c for c, x in CATALOG.items() if x.category == APPLICATION)
HARDWARE_XIDS = frozenset(c for c, x in CATALOG.items() if x.is_gpu_fault)
