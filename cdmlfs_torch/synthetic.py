"""Synthetic image-classification data for benchmarks, GPU checks and examples.

Noise compresses badly and decodes slowly, which would make a benchmark
measure the wrong thing; these images are smooth random fields with a little
grain, so their JPEG sizes (roughly 15-40 KB at 400 px) and decode cost
resemble photographs'.
"""

from __future__ import annotations

import os
import random
import zipfile
from pathlib import Path


def make_image_tree(
    root: str | os.PathLike,
    classes: int = 8,
    per_class: int = 100,
    min_side: int = 300,
    max_side: int = 500,
    seed: int = 0,
    fmt: str = "JPEG",
    workers: int = 1,
) -> list[Path]:
    """Write ``root/class_XX/img_XXXXX.jpg`` files; returns their paths in name order.

    The content depends only on the arguments (``workers`` only splits the work by class).
    """
    jobs = [(Path(root), c, per_class, min_side, max_side, seed, fmt) for c in range(classes)]
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers) as pool:
            parts = list(pool.map(_make_class, jobs))
    else:
        parts = [_make_class(job) for job in jobs]
    return sorted(p for part in parts for p in part)


def _make_class(job: tuple) -> list[Path]:
    import numpy as np
    from PIL import Image

    root, c, per_class, min_side, max_side, seed, fmt = job
    rng = random.Random(f"{seed}:{c}")
    nrng = np.random.default_rng([seed, c])
    ext = {"JPEG": ".jpg", "PNG": ".png"}[fmt]
    d = root / f"class_{c:02d}"
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(per_class):
        w, h = rng.randint(min_side, max_side), rng.randint(min_side, max_side)
        coarse = nrng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
        img = Image.fromarray(coarse).resize((w, h), Image.BICUBIC)
        grain = nrng.integers(-8, 9, (h, w, 3), dtype=np.int16)
        pixels = np.clip(np.asarray(img, dtype=np.int16) + grain, 0, 255).astype(np.uint8)
        path = d / f"img_{i:05d}{ext}"
        Image.fromarray(pixels).save(path, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        out.append(path)
    return out


def zip_tree(
    src: str | os.PathLike,
    dest: str | os.PathLike,
    compression: int = zipfile.ZIP_STORED,
    prefix: str = "",
    shuffle_seed: int | None = None,
) -> Path:
    """Zip every file below ``src`` (member names relative to it, under ``prefix``).

    JPEGs do not compress, so ``ZIP_STORED`` is what image archives usually
    use. ``shuffle_seed`` writes members in a random order, so that archive
    order differs from name order (what the archive-order sampler is about).
    """
    src = Path(src)
    files = sorted(p for p in src.rglob("*") if p.is_file())
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(files)
    with zipfile.ZipFile(dest, "w", compression=compression) as zf:
        for p in files:
            zf.write(p, prefix + p.relative_to(src).as_posix())
    return Path(dest)
