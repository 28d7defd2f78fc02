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
from google.protobuf.message import DecodeError

from fabricwatch import metrics
from fabricwatch.lograte import RateLimitedLogger, install_reconnect_log_limits
from fabricwatch.netaddr import split_host_port
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc

from . import topics
from .admission import TokenBudgets, TokenLimits
from .auth import Collector, TokenAuth
from .decode import pack
from .kafka_limits import KAFKA_DEFAULT_MAX_MESSAGE_BYTES, snapshot_limit_bytes, topic_max_message_bytes
from .validate import validate_snapshot

log = logging.getLogger("fabricwatch.gateway")
# Per-batch warnings (rejections, refused budgets) come at the senders' pace: rate-limited.
_limited_log = RateLimitedLogger(log)
MAX_REJECTIONS_IN_ACK = 20
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# A telemetry record is cut into several above this, unless told the broker's limit
# (`IngestService.max_snapshot_bytes`, from the topic's max.message.bytes).
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
                raise BrokerUnavailable(f"Kafka at {self.bootstrap} answers but the producer did not start: {exc}") from exc
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
    resource_exhausted: Counter = field(default_factory=Counter)   # refused batches by bound hit
    clusters_restamped: int = 0        # snapshots whose own cluster field was replaced by the token's


class IngestService(pb_grpc.IngestServicer):
    """Validates and writes collector batches; who may send what is decided here.

    Everything a snapshot says about itself is bound to its sender's token: its source and
    the node of each rank step must match the token's globs, and its cluster is the
    token's ``cluster:`` (else the gateway's `cluster`), never the snapshot's own field.
    A snapshot that would not fit in one Kafka record (`max_snapshot_bytes`, from the
    broker's ``max.message.bytes`` at start) is refused alone, so its batch is acked and
    the others are written once. Per token, `TokenBudgets` bounds batches and bytes in flight.

    `add_to_server` registers the RPCs with raw-bytes requests, so that a batch is parsed
    only after its token is known and its size admitted; the generated servicer methods
    (`Stream`, `Send`) work too, for callers that register the service themselves.
    """

    def __init__(self, sink: RecordSink, auth: TokenAuth | None = None, cluster: str = "", *,
                 limits: TokenLimits = TokenLimits(),
                 max_snapshot_bytes: int = snapshot_limit_bytes(KAFKA_DEFAULT_MAX_MESSAGE_BYTES)) -> None:
        self.sink = sink
        self.auth = auth
        self.cluster = cluster
        self.max_snapshot_bytes = max_snapshot_bytes
        self.budgets = TokenBudgets(limits)
        self.stats = GatewayStats()

    # -- who is calling -------------------------------------------------------------------
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

    async def _caller(self, context) -> Collector | None:
        collector = self._identify(context)
        if self.auth is not None and collector is None:
            await self._refuse(context)   # raises: the RPC ends here
        return collector

    @staticmethod
    def _budget_key(collector: Collector | None, context) -> str:
        """Whose budget a call draws on: its token's. Without tokens (a loopback gateway) there
        is no one to bound apart: only the gateway-wide byte budget applies ("")."""
        return collector.name if collector is not None else ""

    def cluster_of(self, collector: Collector | None) -> str:
        """The cluster every snapshot of this caller is stamped with."""
        return (collector.cluster if collector is not None and collector.cluster else "") or self.cluster

    # -- RPCs -------------------------------------------------------------------------------
    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register Stream and Send taking raw bytes: parsed after auth and admission."""
        # Send is registered as stream-unary (the wire is the same for a unary client): the
        # handler runs before the request's bytes are read, so a token's reads are admitted first.
        handlers = {
            "Stream": grpc.stream_stream_rpc_method_handler(
                self._stream_raw, request_deserializer=None, response_serializer=pb.IngestAck.SerializeToString),
            "Send": grpc.stream_unary_rpc_method_handler(
                self._send_raw, request_deserializer=None, response_serializer=pb.IngestAck.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("fabricwatch.v1.Ingest", handlers),))

    async def Stream(self, request_iterator: AsyncIterator[pb.IngestBatch], context) -> AsyncIterator[pb.IngestAck]:
        collector = await self._caller(context)
        async for batch in request_iterator:
            yield await self._admitted(batch, batch.ByteSize(), collector, context)

    async def Send(self, request: pb.IngestBatch, context) -> pb.IngestAck:
        collector = await self._caller(context)
        return await self._admitted(request, request.ByteSize(), collector, context)

    async def _stream_raw(self, request_iterator: AsyncIterator[bytes], context) -> AsyncIterator[pb.IngestAck]:
        collector = await self._caller(context)
        async for raw in request_iterator:
            yield await self._admitted(raw, len(raw), collector, context)

    async def _send_raw(self, request_iterator: AsyncIterator[bytes], context) -> pb.IngestAck:
        collector = await self._caller(context)
        token = self._budget_key(collector, context)
        bound = await self.budgets.acquire_read(token)
        if bound:
            await self._over_budget(context, token, bound, 0)
        reading = True

        def admitted(_token: str) -> None:
            nonlocal reading
            reading = False
            self.budgets.release_read(token)

        try:
            raw = b""
            async for raw in request_iterator:      # noqa: B007 - a unary call: exactly one message, used below
                break
            # the read slot is held until the batch is admitted: a message read waits in memory
            # for room only within the token's max_concurrent_reads
            return await self._admitted(raw, len(raw), collector, context, admitted)
        finally:
            if reading:
                self.budgets.release_read(token)

    async def _admitted(self, batch: pb.IngestBatch | bytes, size: int, collector: Collector | None,
                        context, on_admitted=None) -> pb.IngestAck:
        """`ingest` within the caller's token budget; RESOURCE_EXHAUSTED (not acked) past it."""
        token = self._budget_key(collector, context)
        bound = await self.budgets.acquire(token, size)
        if bound:
            await self._over_budget(context, token, bound, size)
        if on_admitted is not None:
            on_admitted(token)
        try:
            if isinstance(batch, bytes):
                try:
                    batch = pb.IngestBatch.FromString(batch)
                except DecodeError:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not an IngestBatch")
            try:
                return await self.ingest(batch, collector, size)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - the Kafka write failed: not acked, the sender resends
                # A short UNAVAILABLE instead of grpc's own traceback per failed stream (a line
                # storm during a broker outage); the cause is logged, rate-limited.
                _limited_log.warning("batch not acked, to be resent: %s: %s", type(exc).__name__, str(exc)[:300])
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"not written to Kafka ({type(exc).__name__}); "
                                                                 "resend later")
        finally:
            self.budgets.release(token, size)

    async def _over_budget(self, context, token: str, bound: str, size: int) -> None:
        self.stats.resource_exhausted[bound] += 1
        metrics.GATEWAY_RESOURCE_EXHAUSTED.labels(bound).inc()
        batches, held = self.budgets.in_flight(token)
        _limited_log.warning("collector %r over its %s bound (%d batches, %d bytes in flight; this one %d bytes): "
                             "refused, to be resent", token or "(no token)", bound, batches, held, size)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"too many batches, reads or bytes in flight for this token ({bound}); back off and resend")

    # -- one batch ------------------------------------------------------------------------------
    async def ingest(self, batch: pb.IngestBatch, collector: Collector | None, size: int | None = None) -> pb.IngestAck:
        # Metrics move once per batch (a batch holds up to 64 snapshots), never per record.
        metrics.GATEWAY_SNAPSHOTS_RECEIVED.inc(len(batch.snapshots))
        metrics.GATEWAY_RECEIVED_BYTES.inc(batch.ByteSize() if size is None else size)
        with metrics.GATEWAY_BATCHES_IN_FLIGHT.track_inprogress():
            ack = await self._ingest(batch, collector)
        metrics.GATEWAY_SNAPSHOTS_ACCEPTED.inc(ack.accepted)
        metrics.GATEWAY_SNAPSHOTS_REJECTED.inc(ack.rejected)
        for reason, count in ack.problems_by_reason.items():
            metrics.GATEWAY_REJECTED_RECORDS.labels(reason).inc(count)
        return ack

    def _verdict(self, snap: pb.Snapshot, collector: Collector | None, cluster: str,
                 now_ns: int) -> tuple[bool, list[tuple[str, str]]]:
        if collector is not None and not collector.may_report(snap.source):
            return False, [("source_not_allowed", f"collector {collector.name!r} may not report for {snap.source!r}")]
        if snap.cluster != cluster:
            if snap.cluster:
                self.stats.clusters_restamped += 1
                metrics.GATEWAY_CLUSTERS_RESTAMPED.inc()
            snap.cluster = cluster          # the token decides the cluster, never the payload
        try:
            verdict = validate_snapshot(snap, now_ns, collector.may_report if collector is not None else None)
        except Exception as exc:  # a validator bug must not make this batch a poison pill
            log.exception("validation of a snapshot from %r failed", snap.source[:64])
            return False, [("validation_error", f"{snap.source[:64]!r}: the gateway could not validate it "
                                                f"({type(exc).__name__})")]
        if verdict.accepted and snap.ByteSize() > self.max_snapshot_bytes:
            # Alone it could never be written: refuse it rather than fail the batch at Kafka.
            return False, [*verdict.problems, ("too_large_for_kafka",
                                               f"{snap.source}: {snap.ByteSize()} bytes; the broker takes records of "
                                               f"at most {self.max_snapshot_bytes} bytes")]
        return verdict.accepted, verdict.problems

    async def _ingest(self, batch: pb.IngestBatch, collector: Collector | None) -> pb.IngestAck:
        ack = pb.IngestAck(batch_id=batch.batch_id)
        accepted: list[pb.Snapshot] = []
        now_ns = time.time_ns()
        cluster = self.cluster_of(collector)
        for index, snap in enumerate(batch.snapshots):
            verdict_ok, problems = self._verdict(snap, collector, cluster, now_ns)
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
        too_big: list[pb.Snapshot] = []
        records = split_records(accepted, now_ns, self.max_snapshot_bytes, too_big)
        for snap in too_big:                     # its counters, packed fixed-width, outgrew the limit
            ack.accepted -= 1
            ack.rejected += 1
            ack.problems_by_reason["too_large_for_kafka"] += 1
            self.stats.problems["too_large_for_kafka"] += 1
            if len(ack.rejections) < MAX_REJECTIONS_IN_ACK:
                ack.rejections.add(index=list(batch.snapshots).index(snap), reason="too_large_for_kafka",
                                   detail=f"{snap.source}: packed above the broker's {self.max_snapshot_bytes} bytes")
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
            _limited_log.warning("batch %d: %d accepted, %d rejected, problems %s", batch.batch_id, ack.accepted,
                                 ack.rejected, dict(ack.problems_by_reason),
                                 extra={"batch_id": batch.batch_id, "collector": collector.name if collector else "",
                                        "problems": dict(ack.problems_by_reason)})
        return ack


def split_records(snaps: list[pb.Snapshot], received_ns: int = 0, max_record_bytes: int = MAX_RECORD_BYTES,
                  refused: list[pb.Snapshot] | None = None) -> list[tuple[str, bytes, bytes]]:
    """A batch's validated snapshots as Kafka records: per source its ticks (rank steps
    removed) in one `SourceRecord` or a few, each at most ``max_record_bytes``; per job its
    rank steps and progress heartbeats in one carrier `Snapshot` or a few. A tick too big for a record alone (its
    counters packed fixed-width) is left out and appended to ``refused``."""
    records: list[tuple[str, bytes, bytes]] = []
    by_source: dict[str, list[pb.Snapshot]] = {}
    by_job: dict[str, list[pb.RankStep | pb.RankProgress]] = {}
    carrier_of: dict[str, pb.Snapshot] = {}
    for snap in snaps:
        for rs in (*snap.rank_steps, *snap.rank_progress):
            by_job.setdefault(rs.job_id, []).append(rs)
            carrier_of.setdefault(rs.job_id, snap)
        if snap.blocks or snap.events:
            by_source.setdefault(snap.source, []).append(snap)
    for source, ticks in by_source.items():
        ticks.sort(key=lambda s: s.time_unix_ns)
        for part in _cut(ticks, lambda part: pack(part, received_ns).SerializeToString(), max_record_bytes, refused):
            records.append((topics.TELEMETRY, source.encode(), part))
    for job_id, items in by_job.items():
        first = carrier_of[job_id]

        def carrier(part: list, first: pb.Snapshot = first) -> bytes:
            return pb.Snapshot(cluster=first.cluster, source=first.source, source_kind=first.source_kind,
                               time_unix_ns=first.time_unix_ns, seq=first.seq,
                               rank_steps=[r for r in part if isinstance(r, pb.RankStep)],
                               rank_progress=[r for r in part if isinstance(r, pb.RankProgress)]).SerializeToString()

        for part in _cut(items, carrier, max_record_bytes, None):
            records.append((topics.RANK_STEPS, job_id.encode(), part))
    return records


def _cut(items: list, encode, max_bytes: int, refused: list | None) -> list[bytes]:
    """One record of these items, or several of consecutive items where one would be too big."""
    data = encode(items)
    if len(data) <= max_bytes:
        return [data]
    if len(items) == 1:
        if refused is not None:
            refused.append(items[0])
        return []
    half = len(items) // 2
    return _cut(items[:half], encode, max_bytes, refused) + _cut(items[half:], encode, max_bytes, refused)


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
    limits: TokenLimits = TokenLimits(),
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the gateway until `stop` is set (or forever)."""
    install_reconnect_log_limits()
    await topics.ensure_topics(bootstrap, topics.ALL_TOPICS)
    max_message_bytes = await topic_max_message_bytes(bootstrap, (topics.TELEMETRY, topics.RANK_STEPS))
    sink = KafkaSink(bootstrap)
    await sink.start()
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ])
    service = IngestService(sink, auth, cluster, limits=limits,
                            max_snapshot_bytes=snapshot_limit_bytes(max_message_bytes))
    service.add_to_server(server)
    if tls:
        port = server.add_secure_port(listen, server_credentials(tls[0], tls[1], client_ca))
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    log.info("gateway listening on %s (%s, %s), writing to %s (records of at most %d bytes)", listen,
             "TLS" if tls else "plaintext", "token auth" if auth else "no auth", bootstrap, max_message_bytes)
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
