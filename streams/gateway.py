"""Ingest gateway: collectors stream snapshots over gRPC; valid ones go to Kafka.

Each snapshot is validated (`streams.validate`). The counters of a batch's snapshots go to
the telemetry topic keyed by source (all samples of an entity land in one partition, in
order), as one `SourceRecord` per source (`streams.decode.pack`: a collector lingers ~2 s,
so a record carries ~20 ticks, and the worker pays its per-record costs once for them
all); the rank steps go to the rank-steps topic keyed by job (a job's ranks meet in one
partition), one record per job and batch. A batch is acked only after Kafka has accepted
every record of it, so a collector that loses its stream resends the unacked batches and
nothing valid is lost.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from fabricwatch import metrics
from fabricwatch.netaddr import split_host_port
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc

from . import topics
from .auth import Collector, TokenAuth
from .decode import pack
from .validate import validate_snapshot

log = logging.getLogger("fabricwatch.gateway")
MAX_REJECTIONS_IN_ACK = 20
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# A telemetry record is cut into several above this (Kafka's default limit is 1 MB).
MAX_RECORD_BYTES = 900 * 1024


class RecordSink(Protocol):
    async def write(self, records: list[tuple[str, bytes, bytes]]) -> None:
        """Durably write (topic, key, value) records, raising if any could not be written."""


# While Kafka is unreachable, aiokafka's sender retries metadata without any backoff: a busy
# loop at a full core and ~4,300 log lines a second (measured: 1.3 M lines in a 5-minute
# outage). So a write still pending after PROBE_AFTER_S probes the brokers over TCP; if none
# answers, the producer is stopped and writes fail at once (the collectors keep their
# batches) until a probe, at most every PROBE_INTERVAL_S, finds a broker again.
PROBE_AFTER_S = 1.0
PROBE_INTERVAL_S = 2.0
PROBE_CONNECT_TIMEOUT_S = 1.0


class BrokerUnavailable(ConnectionError):
    """No broker answers: the batch is not acked and the collector resends it later."""


class KafkaSink:
    """Writes records with aiokafka and waits for every delivery.

    The producer is idempotent. After a broker restart, aiokafka was seen answering every
    send with `OutOfOrderSequenceNumber` for good (it never resets its sequence numbers);
    such a producer is replaced by a new one (a new producer id): the failed batch is not
    acked, the collector resends it, and the gateway does not stay wedged. While no broker
    answers there is no producer at all (see `PROBE_AFTER_S`).
    """

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.producer = self._new_producer()
        self.producer_restarts = 0
        self.broker_outages = 0
        self._restart_lock = asyncio.Lock()
        self._last_probe_s = 0.0

    def _new_producer(self):
        from aiokafka import AIOKafkaProducer

        return AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            acks="all",
            linger_ms=5,
            max_request_size=MAX_MESSAGE_BYTES,
            enable_idempotence=True,
        )

    async def start(self) -> None:
        await self.producer.start()

    async def stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()

    async def write(self, records: list[tuple[str, bytes, bytes]]) -> None:
        from aiokafka.errors import InvalidProducerEpoch, OutOfOrderSequenceNumber, UnknownProducerId

        producer = self.producer or await self._reconnect()
        delivery = asyncio.ensure_future(self._send(producer, records))
        try:
            done, _ = await asyncio.wait([delivery], timeout=PROBE_AFTER_S)
            if not done and not await self._reachable():
                delivery.cancel()
                await self._broker_down(producer)
                raise BrokerUnavailable(f"no Kafka broker answers at {self.bootstrap}")
            await delivery
        except (OutOfOrderSequenceNumber, UnknownProducerId, InvalidProducerEpoch) as exc:
            await self._replace_producer(producer, exc)
            raise

    @staticmethod
    async def _send(producer, records) -> None:
        futures = [await producer.send(topic, value=value, key=key) for topic, key, value in records]
        await asyncio.gather(*futures)

    async def _reachable(self) -> bool:
        """Whether a TCP connection to any bootstrap server opens."""
        for server in self.bootstrap.split(","):
            try:
                host, port = split_host_port(server.strip(), "Kafka bootstrap server")
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError, ValueError):
                continue
            writer.close()
            return True
        return False

    async def _broker_down(self, producer) -> None:
        async with self._restart_lock:
            if self.producer is not producer:
                return
            self.producer = None
            self.broker_outages += 1
            log.warning("no Kafka broker answers at %s: writes refused (not acked) until one does", self.bootstrap)
        # stop() would wait for the pending batches to expire (request timeout, 40 s of the busy
        # loop); they are the collectors' to resend, so they fail now.
        accumulator = getattr(producer, "_message_accumulator", None)
        if accumulator is not None:
            accumulator.fail_all(BrokerUnavailable(f"no Kafka broker answers at {self.bootstrap}"))
        try:
            await asyncio.wait_for(producer.stop(), timeout=5)
        except Exception as exc:
            log.debug("stopping the producer of an unreachable cluster: %s", exc)

    async def _reconnect(self):
        async with self._restart_lock:
            if self.producer is not None:
                return self.producer
            now = time.monotonic()
            if now - self._last_probe_s < PROBE_INTERVAL_S:
                raise BrokerUnavailable(f"no Kafka broker answered at {self.bootstrap} "
                                        f"{now - self._last_probe_s:.1f} s ago")
            self._last_probe_s = now
            if not await self._reachable():
                raise BrokerUnavailable(f"no Kafka broker answers at {self.bootstrap}")
            fresh = self._new_producer()
            try:
                await asyncio.wait_for(fresh.start(), timeout=10)
            except Exception as exc:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(fresh.stop(), timeout=5)
                raise BrokerUnavailable(f"Kafka at {self.bootstrap} answers but the producer did not start: {exc}")
            self.producer = fresh
            log.warning("Kafka broker reachable again at %s: writing", self.bootstrap)
            return fresh

    async def _replace_producer(self, broken, exc: Exception) -> None:
        async with self._restart_lock:
            if self.producer is not broken:      # another stream's failure replaced it already
                return
            log.warning("Kafka producer lost its idempotence state (%s): starting a new producer", exc)
            fresh = self._new_producer()
            await fresh.start()
            self.producer = fresh
            self.producer_restarts += 1
        try:
            await asyncio.wait_for(broken.stop(), timeout=10)
        except Exception as stop_exc:            # the old one is unusable anyway
            log.warning("stopping the replaced Kafka producer failed: %s", stop_exc)


@dataclass
class GatewayStats:
    accepted: int = 0
    rejected: int = 0
    problems: Counter = field(default_factory=Counter)
    unauthenticated_streams: int = 0


class IngestService(pb_grpc.IngestServicer):
    def __init__(self, sink: RecordSink, auth: TokenAuth | None = None, cluster: str = "") -> None:
        self.sink = sink
        self.auth = auth
        self.cluster = cluster
        self.stats = GatewayStats()

    def _identify(self, context: grpc.aio.ServicerContext) -> Collector | None:
        if self.auth is None:
            return None
        metadata = dict(context.invocation_metadata() or ())
        header = metadata.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        return self.auth.identify(token)

    async def _refuse(self, context) -> None:
        self.stats.unauthenticated_streams += 1
        metrics.GATEWAY_UNAUTHENTICATED_STREAMS.inc()
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown collector token")

    async def Stream(self, request_iterator: AsyncIterator[pb.IngestBatch], context) -> AsyncIterator[pb.IngestAck]:
        collector = self._identify(context)
        if self.auth is not None and collector is None:
            await self._refuse(context)
            return
        async for batch in request_iterator:
            yield await self.ingest(batch, collector)

    async def Send(self, request: pb.IngestBatch, context) -> pb.IngestAck:
        collector = self._identify(context)
        if self.auth is not None and collector is None:
            await self._refuse(context)
        return await self.ingest(request, collector)

    async def ingest(self, batch: pb.IngestBatch, collector: Collector | None) -> pb.IngestAck:
        # Metrics move once per batch (a batch holds up to 64 snapshots), never per record.
        metrics.GATEWAY_SNAPSHOTS_RECEIVED.inc(len(batch.snapshots))
        metrics.GATEWAY_RECEIVED_BYTES.inc(batch.ByteSize())
        with metrics.GATEWAY_BATCHES_IN_FLIGHT.track_inprogress():
            ack = await self._ingest(batch, collector)
        metrics.GATEWAY_SNAPSHOTS_ACCEPTED.inc(ack.accepted)
        metrics.GATEWAY_SNAPSHOTS_REJECTED.inc(ack.rejected)
        for reason, count in ack.problems_by_reason.items():
            metrics.GATEWAY_REJECTED_RECORDS.labels(reason).inc(count)
        return ack

    async def _ingest(self, batch: pb.IngestBatch, collector: Collector | None) -> pb.IngestAck:
        ack = pb.IngestAck(batch_id=batch.batch_id)
        accepted: list[pb.Snapshot] = []
        now_ns = time.time_ns()
        for index, snap in enumerate(batch.snapshots):
            if collector is not None and not collector.may_report(snap.source):
                verdict_ok, problems = False, [("source_not_allowed",
                                                f"collector {collector.name!r} may not report for {snap.source!r}")]
            else:
                if not snap.cluster and self.cluster:
                    snap.cluster = self.cluster
                try:
                    verdict = validate_snapshot(snap, now_ns)
                    verdict_ok, problems = verdict.accepted, verdict.problems
                except Exception as exc:  # a validator bug must not make this batch a poison pill
                    log.exception("validation of a snapshot from %r failed", snap.source[:64])
                    detail = f"{snap.source[:64]!r}: the gateway could not validate it ({type(exc).__name__})"
                    verdict_ok, problems = False, [("validation_error", detail)]
            for reason, detail in problems:
                ack.problems_by_reason[reason] += 1
                self.stats.problems[reason] += 1
                if len(ack.rejections) < MAX_REJECTIONS_IN_ACK:
                    ack.rejections.add(index=index, reason=reason, detail=detail)
            if not verdict_ok:
                ack.rejected += 1
                continue
            ack.accepted += 1
            ack.dropped_parts += len(problems)
            accepted.append(snap)
        records = split_records(accepted, now_ns)
        if records:
            started = time.perf_counter()
            try:
                await self.sink.write(records)  # raises -> the batch is not acked -> resent
            except Exception:
                metrics.GATEWAY_KAFKA_WRITE_ERRORS.inc()
                raise
            metrics.GATEWAY_KAFKA_WRITE_SECONDS.observe(time.perf_counter() - started)
        self.stats.accepted += ack.accepted
        self.stats.rejected += ack.rejected
        if ack.rejected or ack.dropped_parts:
            log.warning("batch %d: %d accepted, %d rejected, problems %s", batch.batch_id, ack.accepted,
                        ack.rejected, dict(ack.problems_by_reason),
                        extra={"batch_id": batch.batch_id, "collector": collector.name if collector else "",
                               "problems": dict(ack.problems_by_reason)})
        return ack


def split_records(snaps: list[pb.Snapshot], received_ns: int = 0) -> list[tuple[str, bytes, bytes]]:
    """A batch's validated snapshots as Kafka records: per source its ticks (rank steps
    removed) in one `SourceRecord` or a few, cut below `MAX_RECORD_BYTES`; per job its rank
    steps in one carrier `Snapshot`."""
    records: list[tuple[str, bytes, bytes]] = []
    by_source: dict[str, list[pb.Snapshot]] = {}
    by_job: dict[str, list[pb.RankStep]] = {}
    carrier_of: dict[str, pb.Snapshot] = {}
    for snap in snaps:
        for rs in snap.rank_steps:
            by_job.setdefault(rs.job_id, []).append(rs)
            carrier_of.setdefault(rs.job_id, snap)
        if snap.blocks or snap.events:
            by_source.setdefault(snap.source, []).append(snap)
    for source, ticks in by_source.items():
        ticks.sort(key=lambda s: s.time_unix_ns)
        for part in _packed(ticks, received_ns):
            records.append((topics.TELEMETRY, source.encode(), part))
    for job_id, steps in by_job.items():
        first = carrier_of[job_id]
        carrier = pb.Snapshot(cluster=first.cluster, source=first.source, source_kind=first.source_kind,
                              time_unix_ns=first.time_unix_ns, seq=first.seq, rank_steps=steps)
        records.append((topics.RANK_STEPS, job_id.encode(), carrier.SerializeToString()))
    return records


def _packed(ticks: list[pb.Snapshot], received_ns: int) -> list[bytes]:
    """One record of these ticks, or several of consecutive ticks where one would be too big."""
    data = pack(ticks, received_ns).SerializeToString()
    if len(data) <= MAX_RECORD_BYTES or len(ticks) == 1:
        return [data]
    half = len(ticks) // 2
    return _packed(ticks[:half], received_ns) + _packed(ticks[half:], received_ns)


def server_credentials(cert_path: str, key_path: str, client_ca_path: str | None = None) -> grpc.ServerCredentials:
    with open(key_path, "rb") as fh:
        key = fh.read()
    with open(cert_path, "rb") as fh:
        cert = fh.read()
    client_ca = None
    if client_ca_path:
        with open(client_ca_path, "rb") as fh:
            client_ca = fh.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


async def serve(
    bootstrap: str,
    listen: str = "127.0.0.1:50051",
    *,
    tls: tuple[str, str] | None = None,
    client_ca: str | None = None,
    auth: TokenAuth | None = None,
    cluster: str = "",
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the gateway until `stop` is set (or forever)."""
    await topics.ensure_topics(bootstrap, topics.ALL_TOPICS)
    sink = KafkaSink(bootstrap)
    await sink.start()
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ])
    service = IngestService(sink, auth, cluster)
    pb_grpc.add_IngestServicer_to_server(service, server)
    if tls:
        port = server.add_secure_port(listen, server_credentials(tls[0], tls[1], client_ca))
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    log.info("gateway listening on %s (%s, %s), writing to %s", listen, "TLS" if tls else "plaintext",
             "token auth" if auth else "no auth", bootstrap)
    if ready is not None:
        ready.set()
    try:
        if stop is None:
            await server.wait_for_termination()
        else:
            await stop.wait()
    finally:
        await server.stop(grace=2)
        await sink.stop()
