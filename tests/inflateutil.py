"""Shared by the inflate and checkpoint tests: the compiled extension (or a skip) and realistic data."""

from __future__ import annotations

import importlib
import os
import random
import zlib

import pytest

REQUIRE_NATIVE = os.environ.get("CDMLFS_REQUIRE_NATIVE") == "1"


def native_module(name: str = "cdmlfs._native"):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if REQUIRE_NATIVE:
            pytest.fail(f"CDMLFS_REQUIRE_NATIVE=1 but {name} does not import: {exc}")
        pytest.skip(f"{name} not built: {exc}")


def english_like(n: int, seed: int) -> bytes:
    """Zipf-distributed pseudo-words in sentences: compresses and inflates like prose."""
    rnd = random.Random(seed)
    syllables = ["th", "e", "an", "in", "er", "on", "re", "at", "en", "nd", "st", "or", "ou", "ea", "ti"]
    syllables += ["to", "it", "is", "ha", "ar", "al", "le", "se", "me", "de", "co", "ve", "ri", "ro"]
    vocab = ["".join(rnd.choices(syllables, k=rnd.choice((1, 2, 2, 3, 4)))) for _ in range(5000)]
    weights = [1.0 / (rank + 1) for rank in range(len(vocab))]
    out: list[str] = []
    size = 0
    while size < n:
        line = " ".join(rnd.choices(vocab, weights, k=rnd.randint(4, 20))).capitalize() + ".\n"
        out.append(line)
        size += len(line)
    return "".join(out).encode()[:n]


def deflate(data: bytes, level: int = 6) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()
