"""ratarmount, the benchmarks' baseline, in a venv of its own: installed with pip when missing.

Shared by bench_zip, bench_tar and bench_s3 so that they install it the same way; bench_s3 asks
for s3fs too (ratarmount's S3 support: without it every ``s3://`` mount fails with "fsspec was
not found", and a venv another benchmark made has none).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

DEFAULT_VENV = Path("/tmp/bench-venvs/ratarmount")


def _say(msg: str) -> None:
    print(msg, flush=True)


RATARMOUNT_VERSION = "1.3.0"  # the baseline measured: pinned, so runs compare with the same peer


def ensure_ratarmount(
    venv: Path = DEFAULT_VENV, extras: tuple[str, ...] = (), say: Callable[[str], object] = _say
) -> Path | None:
    """``venv``'s ratarmount with the packages ``extras`` (importable under those names),
    installing what is missing; None when pip cannot, and the caller skips ratarmount."""
    exe = venv / "bin" / "ratarmount"
    python = venv / "bin" / "python"
    if exe.exists() and all(
        subprocess.run([str(python), "-c", f"import {name}"], capture_output=True).returncode == 0
        for name in extras
    ):
        return exe
    say(f"installing {' and '.join(('ratarmount', *extras))} into {venv} ...")
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pinned = f"ratarmount=={RATARMOUNT_VERSION}"
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", pinned, *extras], check=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        say(f"ratarmount unavailable ({exc}): skipping its baselines")
        return None
    return exe if exe.exists() else None
