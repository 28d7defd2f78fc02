"""The words every layer shares: anomaly kinds, cause codes, severities, lifecycles, outcomes.

Written once here and imported by the detectors, the stream layer, the response policy,
the dashboard, the evaluation and the CLI. The strings are wire values: they travel in
`AnomalyEvent.kind` / ``cause_code``, CloudEvents types and headers, Kafka keys, policy
files and docs, so a value never changes; a new one is added here first. Plain ``str``
constants (not enum members) so that a kind read back from protobuf or JSON is the same
object type a detector emitted, and reprs in logs and doctests stay plain.

>>> PFC_STORM in ANOMALY_KINDS and STUCK_HOST in CAUSE_CODES
True
>>> severity_at_least(CRITICAL, WARNING), severity_at_least(INFO, WARNING)
(True, False)
"""
from __future__ import annotations

# -- anomaly kinds (`Finding.kind`, `AnomalyEvent.kind`) -----------------------------------------
LINK_DOWNGRADE = "link_downgrade"          # a NIC or switch link below its nominal rate/width
PCIE_DOWNGRADE = "pcie_downgrade"          # a GPU's or NIC's PCIe link below its maximum
LINK_FLAP = "link_flap"
LINK_DOWN = "link_down"
PFC_STORM = "pfc_storm"
PFC_DEADLOCK = "pfc_deadlock"
ECMP_IMBALANCE = "ecmp_imbalance"
ECN_PFC_MISORDER = "ecn_pfc_misorder"      # ECN marking thresholds above PFC XOFF (congestion tuning)
LOSSLESS_DROP = "lossless_drop"            # drops on a PFC-protected priority
STRAGGLER = "straggler"
HANG = "hang"
GPU_XID = "gpu_xid"
GPU_ECC_UNCORRECTABLE = "gpu_ecc_uncorrectable"
UNKNOWN_ANOMALY = "unknown_anomaly"        # the learned baseline's catch-all

ANOMALY_KINDS = frozenset({LINK_DOWNGRADE, PCIE_DOWNGRADE, LINK_FLAP, LINK_DOWN, PFC_STORM, PFC_DEADLOCK,
                           ECMP_IMBALANCE, ECN_PFC_MISORDER, LOSSLESS_DROP, STRAGGLER, HANG, GPU_XID,
                           GPU_ECC_UNCORRECTABLE, UNKNOWN_ANOMALY})

# -- cause codes (`Finding.cause`, `AnomalyEvent.cause_code`) -------------------------------------
# What can slow a rank or hold up a collective (`models.node_health` finds them on a node).
THERMAL, POWER, NIC_DOWNGRADE, STORM_VICTIM, XID, ECC = "thermal", "power", "nic_downgrade", "storm_victim", "xid", "ecc"
NIC_DOWN, NIC_PCIE, PARTIAL_PAUSE, GPU_PCIE = "nic_down", "nic_pcie", "partial_pause", "gpu_pcie"
NONE, UNKNOWN = "none", "unknown"          # seen and nothing wrong / no telemetry then
NODE_CAUSES = (THERMAL, POWER, NIC_DOWN, NIC_DOWNGRADE, NIC_PCIE, STORM_VICTIM, PARTIAL_PAUSE, GPU_PCIE, XID, ECC)
# A hang's root when no hardware cause explains it (`models.hang`, the simulator's ground truth).
STUCK_PROCESS, PROCESS_LOST = "stuck_process", "process_lost"
HANG_ROOTS = (STUCK_PROCESS, PROCESS_LOST, XID, NIC_DOWN)
# Why a PFC storm's source pauses (`models.storm_locator`).
STUCK_HOST, SILENT_HOST, SWITCH_PORT = "stuck_host", "silent_host", "switch_port"
# One cause per switch-side detector.
ECMP_POLARIZATION = "ecmp_polarization"
PFC_DEADLOCK_CAUSE = "pfc_deadlock"
ECN_THRESHOLD_ABOVE_XOFF = "ecn_threshold_above_xoff"
HEADROOM_MISCONFIG = "headroom_misconfig"

CAUSE_CODES = frozenset({*NODE_CAUSES, NONE, UNKNOWN, *HANG_ROOTS, STUCK_HOST, SILENT_HOST, SWITCH_PORT,
                         ECMP_POLARIZATION, PFC_DEADLOCK_CAUSE, ECN_THRESHOLD_ABOVE_XOFF, HEADROOM_MISCONFIG})

# -- severities, lowest first ---------------------------------------------------------------------
UNSPECIFIED = "unspecified"                # a protobuf enum's zero: a record that did not say
INFO, WARNING, CRITICAL = "info", "warning", "critical"
SEVERITIES = (INFO, WARNING, CRITICAL)
SEVERITY_RANK = {UNSPECIFIED: 0, INFO: 1, WARNING: 2, CRITICAL: 3}


def severity_at_least(severity: str, minimum: str) -> bool:
    """True when ``severity`` is ``minimum`` or worse (unknown names rank lowest)."""
    return SEVERITY_RANK.get(severity, 0) >= SEVERITY_RANK.get(minimum, 0)


# -- lifecycle of an anomaly ----------------------------------------------------------------------
OPEN, UPDATE, RESOLVED = "open", "update", "resolved"
LIFECYCLES = (OPEN, UPDATE, RESOLVED)

# -- outcomes of an action decision (`ActionDecision.outcome`, lower-cased without OUTCOME_) -------
SHADOW, STARTED, EXECUTED, FAILED, ALERTED, ALERT_FAILED = (
    "shadow", "started", "executed", "failed", "alerted", "alert_failed")
REFUSED_KILL_SWITCH, REFUSED_BREAKER, REFUSED_FLAPPING, REFUSED_STALE = (
    "refused_kill_switch", "refused_breaker", "refused_flapping", "refused_stale")
SKIPPED_COOLDOWN, SKIPPED_DUPLICATE, NOT_APPLICABLE, OUTCOME_UNKNOWN = (
    "skipped_cooldown", "skipped_duplicate", "not_applicable", "unknown")
OUTCOMES = (SHADOW, STARTED, EXECUTED, FAILED, ALERTED, ALERT_FAILED, REFUSED_KILL_SWITCH, REFUSED_BREAKER, REFUSED_FLAPPING,
            REFUSED_STALE, SKIPPED_COOLDOWN, SKIPPED_DUPLICATE, NOT_APPLICABLE, OUTCOME_UNKNOWN)
