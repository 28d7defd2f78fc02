"""The detection settings every stage shares (`fabricwatch worker` flags, replay, eval)."""
from __future__ import annotations

from dataclasses import dataclass

from fabricwatch.models.pfc_storm import DEFAULT_DETECTION_TIME_MS
from fabricwatch.models.topology import DEFAULT_NIC_RATE


@dataclass(frozen=True)
class DetectionConfig:
    default_nic_rate: str = DEFAULT_NIC_RATE
    gpu_busy_utilization_pct: float = 20.0
    pfc_detection_time_ms: int = DEFAULT_DETECTION_TIME_MS
    pfc_restoration_time_ms: int | None = None   # default: 2 x detection, as SONiC's pfcwd
    # Live worker only (None = off, as in replay): a finding confirmed by a record the
    # gateway received longer ago than this, by the wall clock, is marked stale (info
    # severity, `sample_age_s` evidence) and re-raised once live records confirm it.
    max_sample_age_s: float | None = None
    # The longest a collector holds ticks before handing them over (the node collector's
    # `gateway.linger_s`). It hands over at once when a port pauses or an XID arrives, so
    # a partition whose sources are lingering has emitted every watchdog change up to its
    # newest tick: the storm stage waits for the slowest source minus this, not for it.
    collector_linger_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.collector_linger_s <= 10:
            raise ValueError(f"collector_linger_s must be within 0..10, got {self.collector_linger_s!r}")
        if self.max_sample_age_s is not None and not self.max_sample_age_s > 0:
            raise ValueError(f"max_sample_age_s must be > 0 or None, got {self.max_sample_age_s!r}")
