"""Byte counts as people read and write them: messages (one wording everywhere) and options."""

from __future__ import annotations

import re
from decimal import Decimal

MAX_SIZE = 1 << 63  # what an off_t / size_t in C takes
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '4096' -> bytes (binary units: 1K = 1024); ValueError otherwise."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"invalid size {text!r} (examples: 512M, 2G, 64MiB)")
    unit = m.group(2).lower()
    power = " kmgtp".index(unit) if unit else 0
    value = int(Decimal(m.group(1)) * (1024**power))  # exact, and no float overflow to infinity
    if value >= MAX_SIZE:
        raise ValueError(f"invalid size {text!r} (too large)")
    return value


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, one decimal; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
