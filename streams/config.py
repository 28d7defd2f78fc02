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

    def __post_init__(self) -> None:
        if self.max_sample_age_s is not None and not self.max_sample_age_s > 0:
            raise ValueError(f"max_sample_age_s must be > 0 or None, got {self.max_sample_age_s!r}")
