"""CRC-32 of a large member's bytes as readers pass over them, in whatever order they come.

A stored member too large to read whole on first access is served straight from
the archive, and checked only once its bytes have all been served. One running
CRC from offset 0 missed that whenever reads did not come exactly in order: a
``head`` of the file and then a full ``cat`` (the second pass started again at
0), the kernel's readahead delivered out of order by a multithreaded loop, or
a reader that seeks to the end first (a video's index) and then reads it all.
Each such member was then never checked, and a flipped byte was served.

Here every read extends, starts or joins *runs* of covered bytes, each with the
CRC of its bytes; two runs that meet are joined with :func:`crc32_combine`. When
one run covers the whole member, its CRC is the member's.
"""

from __future__ import annotations

from bisect import bisect_right

from cdmlfs import inflate

_REFLECTED_POLY = 0xEDB88320  # CRC-32 (zlib, ZIP), bit 31 is the coefficient of x^0


def _multiply(a: int, b: int) -> int:
    """a * b mod P, both polynomials in the reflected bit order."""
    product = 0
    bit = 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _REFLECTED_POLY if b & 1 else b >> 1  # b * x
    return product


def _powers() -> list[int]:
    powers = [1 << 30]  # x^1
    for _ in range(63):
        powers.append(_multiply(powers[-1], powers[-1]))
    return powers


_X_TO_2_TO_THE = _powers()  # x^(2^k) mod P, k = 0..63


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32 of A followed by B, from the CRCs of A and B and the length of B.

    Appending ``len_b`` bytes multiplies A's CRC by x^(8 len_b) modulo the polynomial
    (the pre- and post-inversion of CRC-32 cancel out in this form).
    """
    shift = 8 * len_b
    k = 0
    while shift:
        if shift & 1:
            crc_a = _multiply(_X_TO_2_TO_THE[k], crc_a)
        shift >>= 1
        k += 1
    return crc_a ^ crc_b


class CrcCoverage:
    """The byte runs of a ``total``-byte member read so far, each with the CRC of its bytes.

    At most ``max_runs`` separate runs are kept (a reader jumping all over a huge member would
    otherwise make the list grow with every read): bytes that would start one more are not
    counted, and the member stays unchecked until a later pass covers them. Not thread-safe:
    the caller holds its lock.
    """

    def __init__(self, total: int, max_runs: int = 64) -> None:
        self.total = total
        self.max_runs = max_runs
        self._starts: list[int] = []  # sorted
        self._runs: dict[int, list[int]] = {}  # start -> [end, crc]

    def add(self, offset: int, data) -> int | None:
        """Count ``data`` read at ``offset``; the member's CRC once every byte was counted, else None."""
        view = memoryview(data)
        end = min(offset + len(view), self.total)
        pos = offset
        while pos < end:
            i = bisect_right(self._starts, pos) - 1  # the last run starting at or before pos
            run = self._runs[self._starts[i]] if i >= 0 else None
            if run is not None and pos < run[0]:  # already covered: skip to its end
                pos = min(end, run[0])
                continue
            following = self._starts[i + 1] if i + 1 < len(self._starts) else None
            stop = end if following is None else min(end, following)
            piece = view[pos - offset : stop - offset]
            if run is not None and run[0] == pos:  # extends the run that ends here
                run[1] = inflate.crc32(piece, run[1])
                run[0] = stop
            elif len(self._starts) < self.max_runs:
                run = [stop, inflate.crc32(piece)]
                self._starts.insert(i + 1, pos)
                self._runs[pos] = run
            else:
                pos = stop  # not counted: too many runs already
                continue
            if following is not None and stop == following:  # meets the next run: one run now
                nxt_end, nxt_crc = self._runs.pop(following)
                self._starts.remove(following)
                run[1] = crc32_combine(run[1], nxt_crc, nxt_end - following)
                run[0] = nxt_end
            pos = stop
        first = self._runs.get(0)
        if first is not None and first[0] >= self.total:
            return first[1]
        return None
