"""One small JSON poster shared by every alert sink: timeout, retries, rate limit, bounded time.

`JsonPoster.post` POSTs one JSON document and returns a `SendResult`; it never raises.
It retries with exponential backoff and jitter on 429, 5xx, connection errors and
timeouts (honouring ``Retry-After``), never on other 4xx, and gives up when the next wait
would pass ``total_budget_s``. A `RateLimiter` (one or more token buckets) spaces the
requests of one sink so that a burst of anomalies does not get the webhook blocked.
Sinks whose API answers HTTP 200 with an error code in the body (Feishu, WeCom) pass a
``judge`` that reads the body.

The retry loop is ours, not tenacity's: rewritten on ``tenacity.AsyncRetrying`` it passed
the same tests, but every part of the policy became a custom callback (the wait is
``max(backoff, Retry-After)`` drawn from the poster's ``rng``, the stop is our ``clock``
against the budget with its own reason, a slot the limiter refuses is no attempt), so the
library kept only the loop itself, and the change added 36 lines for 15 removed.
"""
from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from fabricwatch.actions.alerts.base import SendResult

# What a judge says about one HTTP answer.
OK, RETRY, FAIL = "ok", "retry", "fail"
BODY_EXCERPT_CHARS = 300
ANSWER_CHARS = 2000        # of the last answer's body, kept in the `SendResult` (a caller may read its verdict)

#: A judge maps (HTTP status, body text) to (OK | RETRY | FAIL, short reason).
Judge = Callable[[int, str], tuple[str, str]]


def judge_http_status(status: int, body: str) -> tuple[str, str]:
    """2xx is success; 429 and 5xx are worth retrying; any other 4xx will not get better."""
    if 200 <= status < 300:
        return OK, ""
    if status == 429 or status >= 500:
        return RETRY, f"HTTP {status}"
    return FAIL, f"HTTP {status}"


def body_json(body: str) -> dict[str, Any] | None:
    """The body as a JSON object, or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class RetryPolicy:
    """How hard one `post` tries. The whole call, waits included, stays under total_budget_s."""

    timeout_s: float = 10.0          # one attempt, connect to last byte
    max_attempts: int = 5
    backoff_initial_s: float = 0.5   # wait before the 2nd attempt; doubles each time
    backoff_max_s: float = 30.0
    total_budget_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("timeout_s", "backoff_initial_s", "backoff_max_s", "total_budget_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RetryPolicy.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts!r}")

    def backoff_s(self, attempt: int, rng: random.Random) -> float:
        """Wait after failed attempt number `attempt` (1-based): half fixed, half jitter."""
        base_s = min(self.backoff_max_s, self.backoff_initial_s * 2 ** (attempt - 1))
        return base_s / 2 + rng.uniform(0, base_s / 2)


class TokenBucket:
    """`capacity` tokens, refilled at `refill_per_s`; each request takes one.

    >>> now = [0.0]
    >>> bucket = TokenBucket(capacity=2, refill_per_s=1.0, clock=lambda: now[0])
    >>> bucket.wait_s(), bucket.take(), bucket.take(), bucket.wait_s()
    (0.0, None, None, 1.0)
    >>> now[0] = 0.5; bucket.wait_s()
    0.5
    """

    def __init__(self, capacity: float, refill_per_s: float, clock: Callable[[], float] = time.monotonic):
        if capacity < 1:
            raise ValueError(f"TokenBucket capacity must be >= 1, got {capacity!r}")
        if not refill_per_s > 0:
            raise ValueError(f"TokenBucket refill_per_s must be > 0, got {refill_per_s!r}")
        self.capacity = capacity
        self.refill_per_s = refill_per_s
        self.clock = clock
        self._tokens = float(capacity)
        self._last_s = clock()

    def _refill(self) -> None:
        now_s = self.clock()
        self._tokens = min(self.capacity, self._tokens + (now_s - self._last_s) * self.refill_per_s)
        self._last_s = now_s

    def wait_s(self) -> float:
        """Seconds until one token is there (0 when one is there now)."""
        self._refill()
        missing = 1 - self._tokens
        # A float hair short of a token counts as a token: sleeping 1e-17 s would never end.
        return missing / self.refill_per_s if missing > 1e-9 else 0.0

    def take(self) -> None:
        self._refill()
        self._tokens -= 1


class RateLimiter:
    """All of its buckets must have a token (e.g. Feishu: 5 per second and 100 per minute)."""

    def __init__(self, *buckets: TokenBucket, sleep: Callable[[float], Any] = asyncio.sleep):
        self.buckets = buckets
        self.sleep = sleep
        self._lock: asyncio.Lock | None = None

    @classmethod
    def per_window(cls, *limits: tuple[int, float]) -> RateLimiter:
        """From (requests, window_s) pairs; each bucket holds a full window's worth."""
        return cls(*(TokenBucket(capacity=n, refill_per_s=n / window_s) for n, window_s in limits))

    async def acquire(self, max_wait_s: float) -> bool:
        """Take a token from every bucket, waiting at most max_wait_s; False when it would take longer."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:   # one waiter at a time keeps the order of requests
            while True:
                wait_s = max((bucket.wait_s() for bucket in self.buckets), default=0.0)
                if wait_s <= 0:
                    for bucket in self.buckets:
                        bucket.take()
                    return True
                if wait_s > max_wait_s:
                    return False
                await self.sleep(wait_s)
                max_wait_s -= wait_s


def retry_after_s(value: str | None, now_unix_s: float | None = None) -> float | None:
    """Seconds from a Retry-After header: delta-seconds or an HTTP date; None when absent/bad.

    >>> retry_after_s("3"), retry_after_s("soon"), retry_after_s(None)
    (3.0, None, None)
    >>> date = "Wed, 21 Oct 2015 07:28:00 GMT"            # RFC 9110's example; 1445412480 s
    >>> retry_after_s(date, now_unix_s=1445412470.0), retry_after_s(date, now_unix_s=1445412490.0)
    (10.0, 0.0)
    """
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    now_unix_s = time.time() if now_unix_s is None else now_unix_s
    return max(0.0, when.timestamp() - now_unix_s)


class JsonPoster:
    """POSTs JSON for one sink, with its own rate limiter and an HTTP session made on first use.

    ``name`` appears in every `SendResult.detail`. Call `close` when done.
    """

    def __init__(self, name: str, policy: RetryPolicy | None = None, limiter: RateLimiter | None = None,
                 headers: Mapping[str, str] | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Any] = asyncio.sleep):
        self.name = name
        self.policy = policy or RetryPolicy()
        self.limiter = limiter
        self.headers = dict(headers or {})
        self.rng = rng or random.Random()
        self.clock = clock
        self.sleep = sleep
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, url: str, payload: Any, judge: Judge = judge_http_status) -> SendResult:
        """POST `payload` as JSON to `url`; retried as the policy allows. Never raises."""
        try:
            data = json.dumps(payload, ensure_ascii=False).encode()
        except (TypeError, ValueError) as exc:
            return SendResult(False, f"{self.name}: payload is not JSON: {exc}", attempts=0)
        return await self.post_body(url, data, judge)

    async def post_body(self, url: str, data: bytes, judge: Judge = judge_http_status,
                        headers: Mapping[str, str] | None = None) -> SendResult:
        """`post` of a body serialized by the caller (a signed body goes out byte for byte),
        with ``headers`` on top of the poster's. Never raises."""
        deadline_s = self.clock() + self.policy.total_budget_s
        attempt = 0
        reasons: list[str] = []
        while True:
            if self.limiter is not None and not await self.limiter.acquire(deadline_s - self.clock()):
                reasons.append("local rate limit: no slot before the time budget ran out")
                return SendResult(False, self._detail(reasons), attempts=attempt)
            attempt += 1
            verdict, reason, wait_hint_s, answer = await self._attempt(url, data, deadline_s, judge, headers)
            if verdict == OK:
                return SendResult(True, f"{self.name}: {reason}", attempts=attempt, answer=answer)
            reasons.append(reason)
            if verdict == FAIL or attempt >= self.policy.max_attempts:
                return SendResult(False, self._detail(reasons), attempts=attempt, answer=answer)
            wait_s = max(self.policy.backoff_s(attempt, self.rng), wait_hint_s or 0.0)
            if self.clock() + wait_s >= deadline_s:
                reasons.append(f"next retry in {wait_s:.1f} s would pass the "
                               f"{self.policy.total_budget_s:g} s budget")
                return SendResult(False, self._detail(reasons), attempts=attempt, answer=answer)
            await self.sleep(wait_s)

    def _detail(self, reasons: list[str]) -> str:
        # The last reason in full; earlier ones only counted, so the detail stays short.
        earlier = f" (after {len(reasons) - 1} earlier failures: {reasons[0][:80]})" if len(reasons) > 1 else ""
        return f"{self.name}: {reasons[-1]}{earlier}"

    async def _attempt(self, url: str, data: bytes, deadline_s: float, judge: Judge,
                       extra_headers: Mapping[str, str] | None = None) -> tuple[str, str, float | None, str]:
        """One request: (verdict, reason with status and body excerpt, Retry-After seconds, body)."""
        timeout_s = max(0.001, min(self.policy.timeout_s, deadline_s - self.clock()))
        headers = {"Content-Type": "application/json; charset=utf-8", **self.headers, **(extra_headers or {})}
        try:
            if self._session is None:
                self._session = aiohttp.ClientSession()
            async with self._session.post(url, data=data, headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                body = await response.text(errors="replace")
                status = response.status
                hint_s = retry_after_s(response.headers.get("Retry-After"))
        except (asyncio.TimeoutError, TimeoutError):
            return RETRY, f"timeout after {timeout_s:.1f} s", None, ""
        except aiohttp.InvalidURL as exc:
            return FAIL, f"invalid URL {exc}", None, ""
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            return RETRY, f"connection error: {type(exc).__name__}: {exc}", None, ""
        except (aiohttp.ClientError, ValueError) as exc:   # bad header values, unsupported scheme
            return FAIL, f"request error: {type(exc).__name__}: {exc}", None, ""
        verdict, why = judge(status, body)
        excerpt = " ".join(body.split())[:BODY_EXCERPT_CHARS]
        reason = f"HTTP {status}" + (f" {why}" if why and not why.startswith("HTTP") else "")
        return verdict, f"{reason}: {excerpt}" if excerpt else reason, hint_s, body[:ANSWER_CHARS]
