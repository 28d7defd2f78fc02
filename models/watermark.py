"""Low watermarks: how far every live stream of records has been processed, in event time.

A stage that joins several streams (the storm locator over every source's PFC watchdog;
the straggler stage over every telemetry partition's node health) may judge a moment only
once every stream it waits for has been processed past it. `LowWatermark` keeps, per
stream, the event time it has been processed through, and their minimum over the *live*
streams: one that has not advanced while the newest advanced ``liveness_ns`` (a dead node,
an empty partition) is dropped from the minimum, and so is one more than ``max_lag_ns``
behind the newest (a clock far behind). Streams expected but never heard from (`expect`)
count as processed through the time they were expected at. A stream declared `idle`
(nothing left to read: its reader says so) is dropped until it advances again, or until
it is found to have more after all (`revive`). The watermark never moves back; the bare
`minimum_ns` does.

Over sources (nodes, switches: their clocks run live) liveness is judged in event time.
Over *partitions* (`partitions`) it must not be: a partition not read yet while another
drained a backlog minutes ahead is behind, not dead; only its reader can tell idle from
behind, so partitions leave the minimum when declared idle, never on event time.

Cost: a few dict operations per advance, and a scan of the occupied `BUCKET_MS` buckets
per `settle` (a handful while streams are current).

>>> wm = LowWatermark(liveness_ns=10_000_000_000, max_lag_ns=60_000_000_000)
>>> wm.expect(["p0", "p1"], 1_000_000_000)
>>> wm.advance([("p0", 3_000_000_000)]); wm.settle()
1000000000
>>> wm.advance([("p1", 2_000_000_000)]); wm.settle()
2000000000
>>> wm.advance([("p0", 14_000_000_000)]); wm.settle()          # p1 silent while p0 moved > 10 s: dropped
14000000000
>>> parts = LowWatermark.partitions()
>>> parts.expect(["t/0", "t/1"], 0); parts.advance([("t/0", 90_000_000_000)]); parts.settle()   # t/1 not read yet
0
>>> parts.idle("t/1"); parts.settle()
90000000000
>>> parts.revive("t/1"); parts.minimum_ns(), parts.settle()     # more was written there after all
(0, 90000000000)
"""
from __future__ import annotations

from collections import OrderedDict

# Resolution of the low watermark: it may trail the slowest live stream by less than this.
BUCKET_MS = 10
_BUCKET_NS = BUCKET_MS * 1_000_000
# Liveness and lag over partitions: never judged on event time (see the module docstring).
_NEVER_NS = 2**62


class LowWatermark:
    """Processed-through time per stream and its minimum over the live streams.

    Liveness: an ordered dict of the live sources by the newest time at which each last
    advanced (oldest first, so expiring pops the front). Minimum: a count of live sources
    per `BUCKET_MS` bucket of through time; the watermark is the floor of the
    lowest bucket (at most a bucket below the exact minimum). An advance is a few dict
    operations; `settle` scans the occupied buckets, which live sources keep within about
    one sampling interval of each other (a handful), at most max lag / bucket.
    """

    def __init__(self, liveness_ns: int, max_lag_ns: int) -> None:
        self._liveness_ns, self._max_lag_ns = liveness_ns, max_lag_ns
        self.through_ns: dict[str, int] = {}
        self._live: OrderedDict[str, int] = OrderedDict()   # source -> newest_ns when it last advanced
        self._count: dict[int, int] = {}                    # bucket -> live sources processed through it
        self._unheard: set[str] = set()                     # expected, never reported: any report counts
        self._idle: set[str] = set()                        # declared idle: any report revives
        self.newest_ns = 0
        self.value_ns = 0

    @classmethod
    def partitions(cls) -> LowWatermark:
        """Over the partitions of a topic: a partition leaves the minimum only when `idle`."""
        return cls(_NEVER_NS, _NEVER_NS)

    def __setstate__(self, state: dict) -> None:
        state.setdefault("_idle", set())
        self.__dict__.update(state)

    def advance(self, progress) -> None:
        """Apply (source, through_ns) pairs; a time not past a source's own is a redelivery."""
        through, live, count, unheard, idle = self.through_ns, self._live, self._count, self._unheard, self._idle
        newest = self.newest_ns
        for source, through_ns in progress:
            before = through.get(source, -1)
            if through_ns <= before and not (unheard and source in unheard) and not (idle and source in idle):
                continue
            unheard.discard(source)
            idle.discard(source)
            through[source] = through_ns
            if through_ns > newest:
                newest = through_ns
            bucket = through_ns // _BUCKET_NS
            if source in live:
                live.move_to_end(source)
                old = before // _BUCKET_NS
                if old == bucket:
                    live[source] = newest
                    continue
                count[old] -= 1                             # emptied buckets go in `settle`
            count[bucket] = count.get(bucket, 0) + 1
            live[source] = newest
        self.newest_ns = newest

    def expect(self, sources, through_ns: int) -> None:
        """Sources not heard from yet: live from now on, processed through ``through_ns``."""
        for source in sources:
            if source not in self.through_ns:
                self.through_ns[source] = through_ns
                self._unheard.add(source)
                self._live[source] = self.newest_ns
                bucket = through_ns // _BUCKET_NS
                self._count[bucket] = self._count.get(bucket, 0) + 1

    def idle(self, source: str) -> None:
        """``source`` has nothing more to report for now: out of the minimum until it advances."""
        if source in self._live:
            del self._live[source]
            self._count[self.through_ns[source] // _BUCKET_NS] -= 1
        self.through_ns.setdefault(source, self.value_ns)
        self._unheard.discard(source)
        self._idle.add(source)

    def revive(self, source: str) -> None:
        """A `source` declared idle has more to report after all (its reader has not said so
        yet): back in the minimum at the time it was processed through."""
        if source not in self._idle:
            return
        self._idle.discard(source)
        self._live[source] = self.newest_ns
        bucket = self.through_ns[source] // _BUCKET_NS
        self._count[bucket] = self._count.get(bucket, 0) + 1

    def settle(self) -> int:
        """The watermark now: min over live sources, never moving back (newest if none is live)."""
        self.value_ns = max(self.value_ns, self.minimum_ns())
        return self.value_ns

    def holders(self, limit: int = 3) -> list[tuple[str, int]]:
        """The live streams furthest behind, (stream, through_ns), slowest first: what holds
        the watermark (for an operator's log, not the hot path).

        >>> wm = LowWatermark.partitions(); wm.expect(["t/0", "t/1"], 0); wm.advance([("t/0", 5)])
        >>> wm.holders()
        [('t/1', 0), ('t/0', 5)]
        """
        return sorted(((s, self.through_ns[s]) for s in self._live), key=lambda item: (item[1], item[0]))[:limit]

    def minimum_ns(self) -> int:
        """The min over the live sources now (newest if none is live), which moves back when a
        stream revives behind it: for a caller that keeps its own watermark (`settle` does not)."""
        live, count = self._live, self._count
        silent_before = self.newest_ns - self._liveness_ns
        while live and next(iter(live.values())) < silent_before:
            source, _ = live.popitem(last=False)
            count[self.through_ns[source] // _BUCKET_NS] -= 1
        for bucket in [b for b, n in count.items() if not n]:
            del count[bucket]
        lagging_before = (self.newest_ns - self._max_lag_ns) // _BUCKET_NS
        low = min((b for b in count if b >= lagging_before), default=None)
        return self.newest_ns if low is None else low * _BUCKET_NS


class IdleClaims:
    """Streams declared idle, whose claims hold only while each still ends where it was read to.

    A reader that declared its stream (a partition) idle may die right after, and what is
    written there next waits for a new reader while the other streams carry the watermark
    past it. So a claim names the end offset it was read up to, and the watermark passes the
    claimed streams only up to `confirmed_ns`: the minimum as it stood when a look-up of
    their end offsets was asked for (`ask`) that found each claim still at its end
    (`answer`); a stream written past its claim goes back into the minimum
    (`LowWatermark.revive`) until it reports. A claim without an end offset (an older
    writer's) is trusted as it stands.

    >>> wm, claims = LowWatermark.partitions(), IdleClaims()
    >>> wm.expect(["t/0", "t/1"], 0); wm.advance([("t/0", 5_000_000_000)]); wm.idle("t/1"); claims.claim("t/1", 7)
    >>> claims.cap(wm.minimum_ns())                          # not confirmed yet
    0
    >>> claims.ask(wm.minimum_ns(), 0)
    ['t/1']
    >>> claims.answer({"t/1": 7}, wm), claims.cap(wm.minimum_ns())
    ([], 5000000000)
    >>> wm.advance([("t/0", 9_000_000_000)]); claims.ask(wm.minimum_ns(), 5_000_000_000)
    ['t/1']
    >>> claims.answer({"t/1": 8}, wm), claims.cap(wm.minimum_ns())   # written since: waited for again
    (['t/1'], 0)
    """

    def __init__(self) -> None:
        self.ends: dict[str, int] = {}          # stream -> the end offset its claim was read to
        self.confirmed_ns = 0
        self.asked_ns: int | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "asked_ns": None}      # a look-up asked in another process

    def claim(self, stream: str, end_offset: int | None) -> None:
        if end_offset is None:
            self.ends.pop(stream, None)
        else:
            self.ends[stream] = end_offset

    def heard(self, streams) -> None:
        """These reported progress: their claims are over."""
        if self.ends:
            for stream in streams:
                self.ends.pop(stream, None)

    def cap(self, minimum_ns: int) -> int:
        """How far the watermark may go, the minimum over the other streams being ``minimum_ns``."""
        return min(minimum_ns, self.confirmed_ns) if self.ends else minimum_ns

    def ask(self, minimum_ns: int, watermark_ns: int) -> list[str]:
        """The claimed streams whose end offsets to look up now (none: they hold nothing back),
        the minimum noted for the answer."""
        if not self.ends or minimum_ns <= watermark_ns:
            return []
        self.asked_ns = minimum_ns
        return list(self.ends)

    def answer(self, ends_by_stream, wm: LowWatermark) -> list[str]:
        """The end offsets looked up after `ask`: claims still at their end confirm the minimum
        then; those written since are revived in ``wm`` (returned). A claim made since the
        asking is not looked at: its stream was in that minimum."""
        asked, self.asked_ns = self.asked_ns, None
        if asked is None:
            return []
        stale = [s for s, end in self.ends.items() if ends_by_stream.get(s, end) > end]
        for stream in stale:
            del self.ends[stream]
            wm.revive(stream)
        self.confirmed_ns = max(self.confirmed_ns, asked)
        return stale
