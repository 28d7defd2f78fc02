"""The training-rank SDK (`docs/rank-sdk.md`); its code is in `reporter` until the split that follows."""
from .reporter import (HEARTBEAT_INTERVAL_S, InspectorSteps, RankIdentity, RankReporter, StepRecord, clean_name,
                       default_reporter, ingest_nccl_inspector, instrument_torch)

__all__ = ["RankIdentity", "RankReporter", "StepRecord", "InspectorSteps", "default_reporter",
           "instrument_torch", "ingest_nccl_inspector", "HEARTBEAT_INTERVAL_S", "clean_name"]
