"""Coverage-guided fuzzing (atheris) of the gateway's gRPC ingest path, outside pytest.

Each input is the raw bytes of an `IngestBatch` as they would arrive on the wire: decoded
with protobuf, then ingested by the real `IngestService` (validation, splitting into
topic records) into an in-memory sink. A decode error is the expected answer to garbage;
anything else raised, or a `validation_error` in the ack, is a crash. Run::

    python3 tests/fuzz/atheris_ingest.py -max_total_time=300 -rss_limit_mb=2048

(`pip install atheris`; the file name keeps pytest from collecting it.) The run ends with
libFuzzer's counts (`#N ... exec/s`); docs/security.md records the last one.
"""
from __future__ import annotations

import asyncio
import logging
import sys

import atheris

with atheris.instrument_imports():
    from google.protobuf.message import DecodeError

    from fabricwatch.protos.v1 import telemetry_pb2 as pb
    from fabricwatch.streams import topics
    from fabricwatch.streams.gateway import IngestService

LOOP = asyncio.new_event_loop()
logging.disable(logging.CRITICAL)   # rejections are counted in the ack; logging them only slows the run


class MemorySink:
    """Keeps only counts: the fuzzer must not grow memory with what it writes."""

    def __init__(self) -> None:
        self.records = 0

    async def write(self, records: list[tuple[str, bytes, bytes]]) -> None:
        for topic, key, value in records:
            assert topic in (topics.TELEMETRY, topics.RANK_STEPS) and key
            pb.Snapshot.FromString(value)          # what goes to Kafka decodes again
        self.records += len(records)


SERVICE = IngestService(MemorySink(), auth=None, cluster="fuzz")


def one_input(data: bytes) -> None:
    try:
        batch = pb.IngestBatch.FromString(data)
    except DecodeError:
        return
    ack = LOOP.run_until_complete(SERVICE.ingest(batch, None))
    assert ack.accepted + ack.rejected == len(batch.snapshots)
    assert sum(ack.problems_by_reason.values()) >= ack.rejected
    # The gateway turns a validator exception into a `validation_error` rejection (no poison
    # pill on the wire); for the fuzzer it is still a bug in streams/validate.py.
    assert ack.problems_by_reason["validation_error"] == 0, "streams/validate.py raised on this input"


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
