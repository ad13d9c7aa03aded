"""How long a training loop waited for its data: per-batch waits and throughput of one pass.

"Data stall" is the share of wall time the consumer spent inside ``next()``:
the part of each step that faster data loading could remove. The first batch
(worker start-up, prefetch fill) is reported apart, because a long run
amortises it and a short benchmark would otherwise be dominated by it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any


class LoaderMetrics:
    """Accumulates the waits of one pass over a loader; :meth:`as_dict` summarises them."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last = self.start
        self.first_done = self.start
        self.end: float | None = None
        self.waits: list[float] = []
        self.startup = 0.0  # starting the pass (the wrapped loader's workers): part of the first wait
        self.end_wait = 0.0  # the call that found the pass over (workers shutting down)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Times starting the pass before the first ``next()`` (the wrapped loader's workers):
        the consumer waits for it, so it counts in the first wait."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.startup += time.perf_counter() - started

    def add_wait(self, seconds: float) -> None:
        """Record one batch's wait; call it just before handing the batch out."""
        if not self.waits:
            seconds += self.startup
        self.waits.append(seconds)
        self.last = time.perf_counter()
        if len(self.waits) == 1:
            self.first_done = self.last

    def finish(self, waited: float = 0.0) -> None:
        """The pass ended (StopIteration, after ``waited`` seconds in that call): the last batch's
        consumption counts as elapsed time, the call that found the end as waiting."""
        if self.end is None:
            self.end = time.perf_counter()
            self.end_wait = waited

    def as_dict(self) -> dict[str, Any]:
        waits = self.waits
        n = len(waits)
        stop = self.end if self.end is not None else self.last
        elapsed = max(stop - self.start, 1e-12)
        total_wait = sum(waits) + self.end_wait
        out: dict[str, Any] = {
            "batches": n,
            "elapsed_s": elapsed if n else 0.0,
            "batches_per_s": n / elapsed if n else 0.0,
            "wait_s": total_wait,
            "wait_fraction": total_wait / elapsed if n else 0.0,
            "first_wait_s": waits[0] if n else 0.0,
            "wait_ms_mean": 1e3 * sum(waits) / n if n else 0.0,  # of wait_times, as p50/p95/max
            "wait_ms_p50": 1e3 * statistics.median(waits) if n else 0.0,
            "wait_ms_p95": 1e3 * _quantile(waits, 0.95) if n else 0.0,
            "wait_ms_max": 1e3 * max(waits) if n else 0.0,
        }
        # Steady state: from the moment the first batch was handed out. Until the pass
        # ends, the batch last handed out is still being consumed: not counted.
        consumed = n if self.end is not None else n - 1
        if consumed > 0:
            steady_elapsed = max(stop - self.first_done, 1e-12)
            out["steady_batches_per_s"] = consumed / steady_elapsed
            out["steady_wait_fraction"] = (total_wait - waits[0]) / steady_elapsed
        else:
            out["steady_batches_per_s"] = 0.0
            out["steady_wait_fraction"] = 0.0
        return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
