"""Per-token bounds on the gateway's work: how many batches, and how many bytes, at once.

Every node and every training job holds a collector token, so one token must not be able
to take the gateway's memory or its attention from the other collectors: 16 concurrent
calls of 16 MiB from one token once took the gateway from 75 MB to 1.2 GB. Each token
(the anonymous caller of a gateway without tokens counts as one) may have at most
``max_concurrent_batches`` batches being validated and written, holding at most
``max_bytes_in_flight`` bytes of serialized batches together. A batch beyond that is
refused with ``RESOURCE_EXHAUSTED`` (counted); it is not acked, so its sender backs off
and sends it again: nothing valid is lost. One batch alone is always admitted (a legal
batch may be as big as gRPC's message limit), so the bound never blocks a token for good.

>>> budgets = TokenBudgets(TokenLimits(max_concurrent_batches=2, max_bytes_in_flight=100))
>>> budgets.try_acquire("rack-1", 80), budgets.try_acquire("rack-1", 30), budgets.try_acquire("rack-2", 30)
('', 'bytes', '')
>>> budgets.release("rack-1", 80); budgets.try_acquire("rack-1", 30)
''
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_CONCURRENT_BATCHES_PER_TOKEN = 8
MAX_BYTES_IN_FLIGHT_PER_TOKEN = 32 * 1024 * 1024    # two of gRPC's largest messages
# The event feed's fair share: one token (a rack's collectors, a misbehaving client) cannot
# hold every subscription slot (`streams.feed`).
MAX_SUBSCRIPTIONS_PER_TOKEN = 8


@dataclass(frozen=True)
class TokenLimits:
    max_concurrent_batches: int = MAX_CONCURRENT_BATCHES_PER_TOKEN
    max_bytes_in_flight: int = MAX_BYTES_IN_FLIGHT_PER_TOKEN

    def __post_init__(self) -> None:
        if self.max_concurrent_batches < 1 or self.max_bytes_in_flight < 1:
            raise ValueError(f"token limits must be >= 1, got {self}")


@dataclass
class _Use:
    batches: int = 0
    bytes: int = 0


@dataclass
class TokenBudgets:
    """What each token has in flight now; `try_acquire` admits or names the bound that refused."""

    limits: TokenLimits = TokenLimits()
    _in_use: dict[str, _Use] = field(default_factory=dict)

    def try_acquire(self, token: str, size_bytes: int) -> str:
        """"" when admitted (call `release` after), else "batches" or "bytes": the bound hit."""
        use = self._in_use.setdefault(token, _Use())
        if use.batches >= self.limits.max_concurrent_batches:
            return "batches"
        if use.batches and use.bytes + size_bytes > self.limits.max_bytes_in_flight:
            return "bytes"
        use.batches += 1
        use.bytes += size_bytes
        return ""

    def release(self, token: str, size_bytes: int) -> None:
        use = self._in_use[token]
        use.batches -= 1
        use.bytes -= size_bytes
        if not use.batches:
            del self._in_use[token]          # idle tokens keep no state

    def in_flight(self, token: str) -> tuple[int, int]:
        use = self._in_use.get(token)
        return (use.batches, use.bytes) if use else (0, 0)
