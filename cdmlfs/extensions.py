"""Whether an optional C extension of the FUSE path can be used, and why not (for logs and doctor)."""

from __future__ import annotations

import importlib
import os


def availability(module: str, env_var: str, fuse_major: int | None, ready: str) -> tuple[bool, str]:
    """(usable, reason): off when ``env_var=0``, when ``module`` is not built, or without libfuse3."""
    if os.environ.get(env_var, "1") == "0":
        return False, f"disabled by {env_var}=0"
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return False, f"{module} not built: {exc}"
    if fuse_major is not None and fuse_major != 3:
        return False, f"needs libfuse3 (libfuse{fuse_major} loaded)"
    return True, ready
