"""Base directories of the XDG spec, as it defines them."""

from __future__ import annotations

import os


def base_dir(variable: str, *default: str) -> str:
    """``$variable`` when it holds an absolute path, else ``~/<default...>``.

    The spec says a relative value is invalid and to be ignored: taken as it is, the daemon's log
    and the mount point locks landed under whatever directory the command ran in."""
    value = os.environ.get(variable, "")
    if os.path.isabs(value):
        return value
    return os.path.join(os.path.expanduser("~"), *default)
