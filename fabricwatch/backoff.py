"""The reconnect schedule of every long-lived client (collector -> gateway, collector -> switch,
rank reporter -> gateway).

Exponential with jitter: the n-th wait is drawn from [0.5, 1) times ``initial_s * 2**(n-1)``
(capped at ``max_s`` from the second on), so that a fleet of collectors cut off together does not redial in
lockstep; `reset` after a stream that worked starts over from ``initial_s``.

Not tenacity: its retrying wraps one call until it succeeds, while these are loops that
run for days and start over after each stream that worked; its jittered waits are drawn
from [0, step) or step + [0, jitter), not [0.5, 1) times the step; and the collectors,
installed on every node, would carry one more dependency for these lines.

>>> import random
>>> backoff = Backoff(0.5, 2.0, uniform=lambda a, b: b)      # the top of each range
>>> [backoff.next_s() for _ in range(4)]
[0.5, 1.0, 2.0, 2.0]
>>> backoff.step_s, backoff.reset(), backoff.step_s, backoff.next_s()
(2.0, None, 0.0, 0.5)
>>> jittered = Backoff(1.0, 8.0, uniform=random.Random(0).uniform)
>>> all(0.5 * step <= jittered.next_s() < step for step in (1, 2, 4, 8, 8))
True
"""
from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """Waits between reconnects; ``uniform(a, b)`` draws the jitter (default `random.uniform`)."""

    def __init__(self, initial_s: float, max_s: float, uniform: Callable[[float, float], float] = random.uniform) -> None:
        if not (initial_s > 0 and max_s > 0):
            raise ValueError(f"need initial_s and max_s > 0, got {initial_s!r}, {max_s!r}")
        self.initial_s, self.max_s, self.uniform = initial_s, max_s, uniform
        self._step_s = initial_s
        self.step_s = 0.0           # the step the last wait was drawn from; 0: not backing off

    def next_s(self) -> float:
        """The wait before the next attempt; the one after it is drawn from twice the range."""
        self.step_s = self._step_s
        delay_s = self.uniform(0.5, 1.0) * self._step_s
        self._step_s = min(self._step_s * 2, self.max_s)
        return delay_s

    def reset(self) -> None:
        """The stream worked: the next failure waits as the first did."""
        self._step_s = self.initial_s
        self.step_s = 0.0
