"""Rate limits for log lines that repeat at the pace of a retry loop.

While a broker or a gateway is away, every reconnect attempt used to log a line (aiokafka
logs each failed connection, our loops each retry): thousands of lines during one outage,
which bury the one line that matters and fill disks. A `RepeatLimiter` lets the first
`burst` lines of one kind through per `interval_s`, then counts the rest and says how many
it held back on the next line it lets through.

>>> now = [0.0]
>>> limiter = RepeatLimiter(interval_s=30.0, burst=2, clock=lambda: now[0])
>>> [limiter.admit("broker down") for _ in range(5)]
[(True, 0), (True, 0), (False, 0), (False, 0), (False, 0)]
>>> now[0] = 31.0; limiter.admit("broker down")     # a new window: let through, 3 held back
(True, 3)
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

INTERVAL_S = 30.0
BURST = 3
MAX_KEYS = 1024                # distinct message templates tracked; keys are templates, not values
#: Loggers whose repeated lines are retry noise: the Kafka client and our reconnect loops.
RECONNECT_LOGGER_PREFIXES = ("aiokafka",)


@dataclass
class _Window:
    started_s: float
    passed: int = 0
    held: int = 0


@dataclass
class RepeatLimiter:
    interval_s: float = INTERVAL_S
    burst: int = BURST
    clock: Callable[[], float] = time.monotonic
    _windows: dict[object, _Window] = field(default_factory=dict)

    def admit(self, key: object) -> tuple[bool, int]:
        """(let it through?, how many of this key were held back before it)."""
        now_s = self.clock()
        window = self._windows.get(key)
        if window is None or now_s - window.started_s >= self.interval_s:
            held = window.held if window is not None else 0
            if len(self._windows) >= MAX_KEYS and window is None:
                self._windows.clear()
            self._windows[key] = _Window(now_s, passed=1)
            return True, held
        if window.passed < self.burst:
            window.passed += 1
            return True, 0
        window.held += 1
        return False, 0


def _held_note(held: int, interval_s: float) -> str:
    return f" [{held} similar lines held back in the last {interval_s:.0f} s]" if held else ""


class RepeatFilter(logging.Filter):
    """A logging filter built on `RepeatLimiter`, keyed by logger, level and message template."""

    def __init__(self, limiter: RepeatLimiter | None = None) -> None:
        super().__init__()
        self.limiter = limiter or RepeatLimiter()

    def filter(self, record: logging.LogRecord) -> bool:
        ok, held = self.limiter.admit((record.name, record.levelno, str(record.msg)))
        if ok and held:
            record.msg = str(record.msg) + _held_note(held, self.limiter.interval_s).replace("%", "%%")
        return ok


class RateLimitedLogger:
    """``log.warning(...)`` and friends, rate-limited per message template."""

    def __init__(self, logger: logging.Logger, limiter: RepeatLimiter | None = None) -> None:
        self.logger = logger
        self.limiter = limiter or RepeatLimiter()

    def _emit(self, level: int, msg: str, args, kwargs) -> None:
        if not self.logger.isEnabledFor(level):
            return
        ok, held = self.limiter.admit((level, msg))
        if ok:   # stacklevel 3: the line that called warning()/error()/info(), not this module
            self.logger.log(level, msg + _held_note(held, self.limiter.interval_s).replace("%", "%%"),
                            *args, stacklevel=3, **kwargs)

    def warning(self, msg: str, *args, **kwargs) -> None:
        self._emit(logging.WARNING, msg, args, kwargs)

    def error(self, msg: str, *args, **kwargs) -> None:
        self._emit(logging.ERROR, msg, args, kwargs)

    def info(self, msg: str, *args, **kwargs) -> None:
        self._emit(logging.INFO, msg, args, kwargs)


_INSTALLED = RepeatFilter()


def install_reconnect_log_limits() -> RepeatFilter:
    """Attach one shared `RepeatFilter` to every aiokafka logger (idempotent).

    A logger's filters see only the records logged on it, not its children's, so each
    module logger of aiokafka gets the filter; its modules are imported first so that
    they all exist.
    """
    import aiokafka.admin  # noqa: F401 - for their loggers
    import aiokafka.client  # noqa: F401
    import aiokafka.conn  # noqa: F401
    import aiokafka.consumer.fetcher  # noqa: F401
    import aiokafka.consumer.group_coordinator  # noqa: F401
    import aiokafka.producer.sender  # noqa: F401

    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith(RECONNECT_LOGGER_PREFIXES)]
    for name in names:
        logger = logging.getLogger(name)
        if _INSTALLED not in logger.filters:
            logger.addFilter(_INSTALLED)
    return _INSTALLED
