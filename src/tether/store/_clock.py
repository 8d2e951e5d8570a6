"""Store clocks: the time every lease, timer, deadline and retry is measured in.

Workers on one PostgreSQL database must agree on "now": a lease granted by one
worker is judged expired by another, a timer set by one fires on another. Each
worker's own wall clock may be off by seconds (or jump when NTP steps it), so the
PostgreSQL store takes its time from the database server: ``ServerClock`` reads the
server's clock now and then and counts the time in between on the local monotonic
clock, which no one can step. A worker's wall clock is then never read at all.

SQLite runs on one machine, where every process reads the same wall clock, so the
SQLite store uses it as it is: all processes agree, and a step back only delays
lease expiries and timers by the step (nothing fires early, nothing is leased twice).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("tether.store")

#: seconds between two readings of the server's clock
RESYNC_EVERY = 10.0
#: a measured offset larger than this is logged: some host's clock is far off
WARN_OFFSET = 1.0


class ServerClock:
    """The database server's time, counted locally between readings.

    ``sync(read_server)`` takes a reading (``read_server`` returns the server's time
    in seconds since the epoch, one round trip); ``due`` says when the next one is
    wanted. Each reading is uncertain by half its round trip, which a loaded host can
    stretch to tens of milliseconds; of the last ``KEEP`` readings the one with the
    shortest round trip sets the clock (as NTP filters its samples). The value never
    runs backwards.
    """

    #: readings kept to choose the best from (80 s of them at the default interval)
    KEEP = 8

    def __init__(
        self,
        *,
        resync_every: float = RESYNC_EVERY,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.resync_every = resync_every
        self.wall = wall  #: only to report how far this host's clock is off
        self.monotonic = monotonic
        self.offset = 0.0  #: server time minus this host's wall time, at the last reading
        #: (round trip, server time minus monotonic time) of the last readings
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=self.KEEP)
        self._skew: float | None = None  #: server time minus monotonic time, chosen
        self._at = 0.0  #: monotonic time of the last reading
        self._last = 0.0
        self._lock = threading.Lock()

    def sync(self, read_server: Callable[[], float]) -> None:
        """Read the server's clock (from a thread that may block on the database)."""
        before = self.monotonic()
        server = read_server()
        after = self.monotonic()
        rtt = after - before
        # the reading was taken about half a round trip in: at monotonic (before+after)/2
        skew = server - (before + after) / 2
        offset = server - self.wall()
        if abs(offset) > WARN_OFFSET and abs(offset - self.offset) > WARN_OFFSET:
            log.warning(
                "this host's clock is %.1f s %s the database server's; tether uses the "
                "server's time (see docs/deploy.md, Clocks)",
                abs(offset),
                "behind" if offset > 0 else "ahead of",
            )
        with self._lock:
            self.offset = offset
            self._samples.append((rtt, skew))
            self._skew = min(self._samples)[1]  # the most certain reading
            self._at = after

    def due(self) -> bool:
        """Whether the next reading of the server's clock is wanted."""
        return self._skew is None or self.monotonic() - self._at >= self.resync_every

    def __call__(self) -> float:
        with self._lock:
            skew = self._skew  # None: not read yet (only before the store is open)
            now = self.wall() if skew is None else self.monotonic() + skew
            if now < self._last:
                return self._last
            self._last = now
            return now
