"""JSON encoding of the records that pass between the worker's stages.

`PauseStateChange` (watchdog -> storm locator) travels on the pause-states topic. These
are internal records, versioned by the topic name; the public ones are protobuf.

>>> from fabricwatch.models.findings import EntityRef, Evidence
>>> c = PauseStateChange(EntityRef(cluster="c1", node="n1", device="mlx5_0", port="1"), 3, "pausing", True,
...                      10, 20, [Evidence("tx_pause_duty", 0.99, 0.95, "ratio")])
>>> pause_change_from_json(pause_change_to_json(c)) == c
True
"""
from __future__ import annotations

import dataclasses
import json

from fabricwatch.models.findings import EntityRef, Evidence
from fabricwatch.models.pfc_storm import PauseStateChange


class RecordError(ValueError):
    """An internal record that cannot be decoded."""


def pause_change_to_json(change: PauseStateChange) -> bytes:
    return json.dumps(dataclasses.asdict(change), separators=(",", ":")).encode()


def pause_change_from_json(raw: bytes) -> PauseStateChange:
    try:
        doc = json.loads(raw)
        return PauseStateChange(
            entity=EntityRef(**doc["entity"]), priority=int(doc["priority"]), role=str(doc["role"]),
            active=bool(doc["active"]), onset_ns=int(doc["onset_ns"]), at_ns=int(doc["at_ns"]),
            evidence=[Evidence(**e) for e in doc.get("evidence", [])],
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise RecordError(f"not a pause-state record: {exc}") from exc
