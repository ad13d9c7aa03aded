"""Retry policy for network reads: jittered exponential backoff, bounded in attempts *and* time.

Why our own loop instead of botocore's retry modes: botocore retries only what
happens before the body is read (status codes, connection errors while sending
the request). A body that stalls past the read timeout, is cut short, or whose
connection is reset half-way fails *while we read it*, after botocore has
returned. One loop around request + body read covers all of these the same way,
and bounds the total time a FUSE read can hang.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long a single ranged read may be retried.

    Delays use "full jitter": attempt ``k`` (0-based) sleeps a uniform random
    time in ``[0, min(max_delay, base_delay * 2**k)]``, so many clients throttled
    together do not retry in lockstep. A read gives up after ``max_attempts``
    attempts or once ``deadline`` seconds have passed since its first attempt,
    whichever comes first; a sleep that would end past the deadline is not taken.
    """

    max_attempts: int = 7
    base_delay: float = 0.1
    max_delay: float = 5.0
    deadline: float = 60.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Backoff before retry number ``attempt + 1`` (``attempt`` counts failures so far, from 0)."""
        ceiling = min(self.max_delay, self.base_delay * (2 ** min(attempt, 30)))
        return (rng or random).uniform(0.0, ceiling)

    def next_delay(self, failures: int, started: float, now: float | None = None) -> float | None:
        """Seconds to sleep before the next attempt, or None when the read must give up.

        ``failures`` is the number of failed attempts so far (>= 1), ``started``
        the ``time.monotonic()`` of the first attempt. Every wait of an attempt
        ends by the deadline (the caller bounds reply headers and bodies by it), so
        any attempt that can start before the deadline is made: a stall that ate
        half the budget still leaves a retry (it used to leave none, and one
        stalled request became an EIO with ``--read-deadline`` under 40 s).
        """
        if failures >= self.max_attempts:
            return None
        now = time.monotonic() if now is None else now
        pause = self.delay(failures - 1)
        if now + pause >= started + self.deadline:
            return None
        return pause

    def timeouts(self, connect: float, read: float) -> tuple[float, float]:
        """Socket timeouts that fit the deadline: each at most half of it (the defaults, 5 s and
        20 s, are far below the default 60 s deadline)."""
        cap = max(0.5, self.deadline / 2)
        return min(connect, cap), min(read, cap)
