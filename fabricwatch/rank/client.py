"""The rank reporter's gRPC client of the gateway's ``Ingest.Send``.

Turns queued step tuples and the progress heartbeat into ``Snapshot`` messages, one per
node, and sends them in one ``IngestBatch``. Separate from the reporter so that grpc and
the protobufs are imported only here, in the sender thread, never on
``import fabricwatch.rank`` (a training script pays nothing for them until it reports).
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from fabricwatch.grpc_tls import channel_credentials

if TYPE_CHECKING:
    from .reporter import RankReporter

MAX_STEP_SECONDS = 24 * 3600.0    # the gateway drops longer steps (bad_rank_step)


class IngestClient:
    """A small synchronous gRPC client of ``Ingest.Send`` (grpc imported here, lazily)."""

    def __init__(self, reporter: RankReporter) -> None:
        import grpc

        from fabricwatch.protos.v1 import telemetry_pb2 as pb
        from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc

        self.grpc, self.pb, self.r = grpc, pb, reporter
        options = [("grpc.max_send_message_length", 16 * 1024 * 1024),
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 5000)]
        if reporter.server_name:
            options.append(("grpc.ssl_target_name_override", reporter.server_name))
        if reporter.ca_cert:
            creds = channel_credentials(reporter.ca_cert, reporter.client_cert, reporter.client_key)
            self.channel = grpc.secure_channel(reporter.gateway, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(reporter.gateway, options=options)
        self.send_rpc = pb_grpc.IngestStub(self.channel).Send
        self.metadata = (("authorization", f"Bearer {reporter.token}"),) if reporter.token else None
        self.seq = 0

    def send(self, batch: list[tuple], batch_id: int, timeout: float, beat: tuple | None = None):
        pb = self.pb
        by_node: dict[str, list] = {}
        if beat is not None:
            by_node[beat[3]] = []
        for rec in batch:
            by_node.setdefault(rec[3], []).append(pb.RankStep(
                job_id=rec[0], rank=rec[1], world_size=rec[2], node=rec[3], local_gpu=rec[4], step=rec[5],
                start_unix_ns=rec[6], step_seconds=_finite(rec[7]), busy_seconds=_finite(rec[8]),
                collective_wait_seconds=_finite(rec[9])))
        now = time.time_ns()
        snaps = []
        for node, steps in by_node.items():
            self.seq += 1
            snap = pb.Snapshot(cluster=self.r.cluster, source=node, source_kind=pb.SOURCE_KIND_NODE,
                               time_unix_ns=now, seq=self.seq, rank_steps=steps)
            if beat is not None and node == beat[3]:
                snap.rank_progress.add(job_id=beat[0], rank=beat[1], world_size=beat[2], node=beat[3],
                                       local_gpu=beat[4], time_unix_ns=beat[5], collectives_entered=beat[6],
                                       collectives_completed=beat[7], last_entered_unix_ns=beat[8],
                                       last_completed_unix_ns=beat[9], step=beat[10])
            snaps.append(snap)
        try:
            ack = self.send_rpc(pb.IngestBatch(batch_id=batch_id, snapshots=snaps), timeout=timeout,
                                metadata=self.metadata)
        except self.grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code == self.grpc.StatusCode.UNAUTHENTICATED:
                self.r._warn_once("the gateway %s refused our token (FABRICWATCH_TOKEN); rank steps are dropped "
                                  "once %d are buffered", self.r.gateway, self.r.max_buffered)
            else:
                self.r._warn_once("gateway %s unreachable (%s); up to %d rank steps are kept and retried",
                                  self.r.gateway, getattr(code, "name", exc), self.r.max_buffered)
            return False, None
        return True, ack

    def close(self) -> None:
        try:
            self.channel.close()
        except Exception:   # noqa: BLE001
            pass


def _finite(x: float) -> float:
    """Clamp a timing to what the gateway accepts (tiny negative clock noise -> 0)."""
    x = float(x)
    if math.isnan(x):
        return 0.0
    return min(max(x, 0.0), MAX_STEP_SECONDS)

