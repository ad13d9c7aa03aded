"""Access-pattern detection for remote reads: sequential streams and header-then-data pairs.

Two patterns decide how much to fetch beyond what a read asks for:

* **Sequential streams** (a member read front to back, the ZIP central
  directory read window after window, a tar scan, neighbouring small members
  read in archive order). Each stream remembers where it expects the next read;
  reads that land near that point (a little behind: a multithreaded FUSE loop
  delivers the kernel's readahead out of order; a little ahead: gaps between
  neighbouring members) extend it. Once a stream is established, it asks for a
  prefetch window ahead of the reader that doubles on every refill, up to a
  maximum, so a short sequential burst costs little and a long scan reaches
  full parallelism quickly.
* **Header probes**: the ZIP format reads a member's 30-byte local header and
  then its data right behind it, two dependent reads. A tiny read is therefore
  expanded to the span such probes were followed by recently (a high
  percentile of the last few), so one request usually brings header and data
  together, while random access to small members fetches little more than it
  needs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

KiB = 1 << 10
MiB = 1 << 20


@dataclass
class ReadaheadConfig:
    min_window: int = 16 * KiB  # smallest first prefetch (it starts at twice what the stream read)
    max_window: int = 64 * MiB  # prefetch never runs further ahead than this
    forward_gap: int = 16 * KiB  # a read this far past a stream's end still continues it
    min_hits: int = 5  # advancing reads before a stream prefetches (2 when reads are large)
    large_read: int = 64 * KiB
    max_streams: int = 32
    tiny_read: int = 1 * KiB  # reads this short are header probes
    probe_initial: int = 16 * KiB  # expansion before anything was learned
    probe_min: int = 2 * KiB
    probe_max: int = 1 * MiB
    probe_history: int = 32


class Stream:
    """One sequential reader: where it is, how far ahead it has been served, how far to look."""

    __slots__ = ("ahead", "first", "hits", "next", "prefetched", "shared", "window")

    def __init__(self, start: int, end: int) -> None:
        self.first = start  # where the stream began
        self.next = end  # where the next read is expected
        self.ahead = end  # everything before this was already read or asked for
        self.window = 0  # prefetch distance; set when the stream proves sequential
        self.hits = 1
        self.prefetched: deque = deque()  # spans prefetched for this stream (for drop-behind)
        # Read by several threads at once, out of order (a multithreaded FUSE loop serving kernel
        # readahead): its prefetches are received into buffers, not left as open bodies.
        self.shared = False


class StreamTable:
    """The recent sequential streams of one source (thread-safe)."""

    def __init__(self, config: ReadaheadConfig) -> None:
        self.config = config
        self._streams: OrderedDict[int, Stream] = OrderedDict()  # id -> stream, least recent first
        self._next_id = 0
        self._lock = threading.Lock()

    def observe(self, offset: int, length: int, size: int) -> tuple[Stream, tuple[int, int] | None]:
        """Account for a read; return its stream and the range to prefetch now (or None)."""
        cfg = self.config
        end = offset + length
        with self._lock:
            stream = self._match(offset, length)
            if stream is None:
                stream = Stream(offset, end)
                self._streams[self._next_id] = stream
                self._next_id += 1
                if len(self._streams) > cfg.max_streams:
                    self._streams.popitem(last=False)
                return stream, None
            if end <= stream.next:
                return stream, None  # a re-read or a late out-of-order read: no evidence of progress
            stream.hits += 1
            stream.next = end
            stream.ahead = max(stream.ahead, stream.next)
            needed = cfg.min_hits if length < cfg.large_read else min(2, cfg.min_hits)
            if stream.hits < needed:
                return stream, None
            if not stream.window:
                # Ramp up from what the stream has consumed: two random neighbours that look
                # sequential cost a few KiB of prefetch, a real scan doubles to full speed fast.
                consumed = stream.next - stream.first
                stream.window = max(cfg.min_window, min(2 * consumed, cfg.max_window))
            target = min(size, stream.next + stream.window)
            # Refill once less than half a window is left ahead of the reader.
            if stream.ahead - stream.next > stream.window // 2 or stream.ahead >= target:
                return stream, None
            lo = stream.ahead
            stream.ahead = target
            stream.window = min(stream.window * 2, cfg.max_window)
            return stream, (lo, target)

    def _match(self, offset: int, length: int) -> Stream | None:
        cfg = self.config
        # Large reads come from kernel readahead, several in flight and delivered out of order by a
        # multithreaded FUSE loop: a jump of a few reads ahead still belongs to the same stream.
        gap = max(cfg.forward_gap, 8 * length if length >= cfg.large_read else length)
        best_id = None
        best_dist = None
        for sid, s in self._streams.items():
            # Behind the expected point (out-of-order delivery) but not before the stream began,
            # or a small jump ahead (the gap between neighbouring members).
            if max(s.first, s.next - max(s.window, cfg.max_window // 4)) <= offset <= s.next + gap:
                dist = abs(offset - s.next)
                if best_dist is None or dist < best_dist:
                    best_id, best_dist = sid, dist
        if best_id is None:
            return None
        self._streams.move_to_end(best_id)
        return self._streams[best_id]

    def clear(self) -> None:
        with self._lock:
            self._streams.clear()


class ProbeLearner:
    """Learns how far past a tiny header probe the following read reaches (thread-safe)."""

    def __init__(self, config: ReadaheadConfig) -> None:
        self.config = config
        self._probes: OrderedDict[int, None] = OrderedDict()  # recent tiny-read offsets
        self._spans: deque[int] = deque(maxlen=config.probe_history)
        self._expansion = config.probe_initial
        self._lock = threading.Lock()

    @property
    def expansion(self) -> int:
        return self._expansion

    def observe(self, offset: int, length: int) -> int:
        """Account for a read; return how many bytes from ``offset`` to fetch on a miss (0: as asked)."""
        cfg = self.config
        with self._lock:
            probe = self._follows(offset)
            if probe is not None:
                self._spans.append(offset + length - probe)
                self._expansion = self._estimate()
            if length <= cfg.tiny_read:
                self._probes[offset] = None
                self._probes.move_to_end(offset)
                if len(self._probes) > 64:
                    self._probes.popitem(last=False)
                return max(self._expansion, length)
        return 0

    def _follows(self, offset: int) -> int | None:
        """The most recent probe shortly before ``offset`` (consumed: each probe teaches once)."""
        limit = self.config.probe_max
        best = None
        for p in reversed(self._probes):
            if p < offset <= p + limit and (best is None or p > best):
                best = p
        if best is not None:
            del self._probes[best]
        return best

    def _estimate(self) -> int:
        cfg = self.config
        spans = sorted(self._spans)
        p75 = spans[(len(spans) * 3) // 4] if len(spans) > 1 else spans[0]
        # A little slack for variable-length names and extra fields, rounded to 512 bytes.
        want = (p75 + 256 + 511) // 512 * 512
        return max(cfg.probe_min, min(cfg.probe_max, want))
