"""Per-token bounds on the gateway's work: how many batches, and how many bytes, at once.

Every node and every training job holds a collector token, so one token must not be able
to take the gateway's memory or its attention from the other collectors: 16 concurrent
calls of 16 MiB from one token once took the gateway from 75 MB to 1.2 GB. Each token
(the anonymous caller of a gateway without tokens counts as one) may have

* at most ``max_concurrent_batches`` batches being validated and written, holding at most
  ``max_bytes_in_flight`` bytes of serialized batches together (one batch alone is always
  admitted: a legal batch may be as big as gRPC's message limit). Measured: one 15 MiB
  batch costs the gateway ~130 MB while it is parsed, validated and written (parsed copy,
  serialized records, the Kafka client's buffers), so the byte bounds are what bound memory;
* and all tokens together at most ``max_bytes_in_flight_total`` (one token alone is never
  refused by it), so many busy tokens cannot add up to an out-of-memory either;
* at most ``max_concurrent_reads`` unary calls whose message is being received: a ``Send``
  is admitted *before* its bytes are read, so concurrent large calls of one token queue up
  instead of all sitting in memory at once.

The caller of a gateway without tokens (loopback only) has no identity to be bounded by:
its key ``""`` is held to the gateway-wide budget alone.

A batch that finds no room waits up to ``max_wait_s`` (collectors that tick in step share
a token in bursts), then is refused with ``RESOURCE_EXHAUSTED`` (counted). It is not
acked, so its sender backs off and sends it again: nothing valid is lost.

>>> budgets = TokenBudgets(TokenLimits(max_concurrent_batches=2, max_bytes_in_flight=100))
>>> budgets.try_acquire("rack-1", 80), budgets.try_acquire("rack-1", 30), budgets.try_acquire("rack-2", 30)
('', 'bytes', '')
>>> budgets.release("rack-1", 80); budgets.try_acquire("rack-1", 30)
''
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

MAX_CONCURRENT_BATCHES_PER_TOKEN = 8
MAX_BYTES_IN_FLIGHT_PER_TOKEN = 16 * 1024 * 1024    # one of gRPC's largest messages, or ~16 usual batches
MAX_BYTES_IN_FLIGHT_TOTAL = 128 * 1024 * 1024
MAX_CONCURRENT_READS_PER_TOKEN = 2                  # unary calls receiving their message at once
MAX_ADMISSION_WAIT_S = 1.0                          # a burst waits this long for room before RESOURCE_EXHAUSTED
# The event feed's fair share: one token (a rack's collectors, a misbehaving client) cannot
# hold every subscription slot (`streams.feed`).
MAX_SUBSCRIPTIONS_PER_TOKEN = 8


@dataclass(frozen=True)
class TokenLimits:
    max_concurrent_batches: int = MAX_CONCURRENT_BATCHES_PER_TOKEN
    max_bytes_in_flight: int = MAX_BYTES_IN_FLIGHT_PER_TOKEN
    max_concurrent_reads: int = MAX_CONCURRENT_READS_PER_TOKEN
    max_wait_s: float = MAX_ADMISSION_WAIT_S
    max_bytes_in_flight_total: int = MAX_BYTES_IN_FLIGHT_TOTAL

    def __post_init__(self) -> None:
        if min(self.max_concurrent_batches, self.max_bytes_in_flight, self.max_concurrent_reads,
               self.max_bytes_in_flight_total) < 1 \
                or not 0 <= self.max_wait_s <= 60:
            raise ValueError(f"token limits must be >= 1 and max_wait_s in [0, 60], got {self}")


@dataclass
class _Use:
    batches: int = 0
    bytes: int = 0
    reads: int = 0

    @property
    def idle(self) -> bool:
        return not (self.batches or self.reads)


@dataclass
class TokenBudgets:
    """What each token has in flight now; `try_acquire` admits or names the bound that refused."""

    limits: TokenLimits = TokenLimits()
    _in_use: dict[str, _Use] = field(default_factory=dict)
    _waiters: list[asyncio.Future] = field(default_factory=list)
    _total_bytes: int = 0

    def try_acquire(self, token: str, size_bytes: int) -> str:
        """"" when admitted (call `release` after), else "batches", "bytes" or "gateway_bytes"."""
        use = self._in_use.setdefault(token, _Use())
        if token and use.batches >= self.limits.max_concurrent_batches:
            bound = "batches"
        elif token and use.batches and use.bytes + size_bytes > self.limits.max_bytes_in_flight:
            bound = "bytes"
        elif self._total_bytes > use.bytes and self._total_bytes + size_bytes > self.limits.max_bytes_in_flight_total:
            bound = "gateway_bytes"      # other tokens hold the gateway's byte budget
        else:
            use.batches += 1
            use.bytes += size_bytes
            self._total_bytes += size_bytes
            return ""
        self._forget_if_idle(token)
        return bound

    def release(self, token: str, size_bytes: int) -> None:
        use = self._in_use[token]
        use.batches -= 1
        use.bytes -= size_bytes
        self._total_bytes -= size_bytes
        self._forget_if_idle(token)
        self._wake()

    async def acquire(self, token: str, size_bytes: int) -> str:
        """`try_acquire`, waiting up to ``max_wait_s`` for room."""
        return await self._waiting(lambda: self.try_acquire(token, size_bytes))

    async def acquire_read(self, token: str) -> str:
        """A slot to receive one unary call's message ("" or "reads"); `release_read` after."""
        def attempt() -> str:
            use = self._in_use.setdefault(token, _Use())
            if token and use.reads >= self.limits.max_concurrent_reads:
                self._forget_if_idle(token)
                return "reads"
            use.reads += 1
            return ""
        return await self._waiting(attempt)

    def release_read(self, token: str) -> None:
        self._in_use[token].reads -= 1
        self._forget_if_idle(token)
        self._wake()

    def in_flight(self, token: str) -> tuple[int, int]:
        use = self._in_use.get(token)
        return (use.batches, use.bytes) if use else (0, 0)

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    # -- waiting for room -------------------------------------------------------------------------
    async def _waiting(self, attempt) -> str:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.max_wait_s
        while True:
            bound = attempt()
            left = deadline - loop.time()
            if not bound or left <= 0:
                return bound
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except asyncio.TimeoutError:
                pass
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _forget_if_idle(self, token: str) -> None:
        use = self._in_use.get(token)
        if use is not None and use.idle:
            del self._in_use[token]          # idle tokens keep no state
