#!/usr/bin/env python3
"""Demo: build a small ImageFolder-style ZIP, mount it, list it, train-read it with torchvision, unmount.

Run through ``scripts/demo.sh`` (which installs everything first), or directly
with the project's venv: ``.venv/bin/python scripts/demo.py``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
import zipfile
from io import BytesIO
from pathlib import Path


def build_dataset(path: Path, classes: int = 5, per_class: int = 40) -> int:
    """JPEGs of random colours and sizes under train/<class>/, stored (JPEG is already compressed)."""
    from PIL import Image

    rng = random.Random(0)
    n = 0
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for c in range(classes):
            for i in range(per_class):
                img = Image.new("RGB", (rng.randint(64, 160), rng.randint(64, 160)),
                                tuple(rng.randrange(256) for _ in range(3)))  # fmt: skip
                buf = BytesIO()
                img.save(buf, "JPEG", quality=85)
                zf.writestr(f"train/class_{c}/img_{i:04d}.jpg", buf.getvalue())
                n += 1
    return n


def cdmlfs(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "cdmlfs", *args], check=True)


def main() -> int:
    import torch
    from torchvision import datasets, transforms

    with tempfile.TemporaryDirectory(prefix="cdmlfs-demo-") as tmp:
        archive = Path(tmp) / "demo.zip"
        mnt = Path(tmp) / "mnt"
        mnt.mkdir()
        n = build_dataset(archive)
        print(f"built {archive} ({n} JPEGs, {archive.stat().st_size / 1024:.0f} KiB)")

        t = time.perf_counter()
        cdmlfs("mount", str(archive), str(mnt), "--cache-size", "64M")
        print(f"mounted on {mnt} in {time.perf_counter() - t:.2f}s")
        try:
            print("$ ls", mnt / "train")
            print("  " + "  ".join(sorted(os.listdir(mnt / "train"))))
            ds = datasets.ImageFolder(
                str(mnt / "train"),
                transform=transforms.Compose([transforms.RandomResizedCrop(64), transforms.ToTensor()]),
            )
            loader = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, num_workers=2)
            t = time.perf_counter()
            seen = 0
            shape = None
            for images, labels in loader:
                seen += len(labels)
                shape = tuple(images.shape)
            dt = time.perf_counter() - t
            print(
                f"torchvision ImageFolder on the mount: {len(ds.classes)} classes, {len(ds)} images, "
                f"one epoch in {dt:.2f}s ({seen / dt:.0f} images/s), batch {shape}"
            )
        finally:
            cdmlfs("umount", str(mnt))
            print(f"unmounted {mnt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
