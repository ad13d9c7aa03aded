"""How member names become safe paths inside the mount.

The rule (documented in the README, tested in tests/test_pathrules.py):

* In ZIP names ``\\`` is a separator, like ``/`` (Windows tools write it; no
  sane dataset has a backslash inside a file name). In tar names it is an
  ordinary character, as for GNU tar (``a\\b`` and ``a/b`` are two files).
* Leading ``/`` (absolute paths), empty components and ``.`` are dropped.
* ``..`` removes the previous component and is dropped at the root, so no
  name can point outside the mount.
* NUL characters become ``_``.
* A component longer than 255 bytes (the kernel's NAME_MAX) is cut to 240 bytes
  plus ``~`` and 8 hex digits of a hash of the full component, which keeps it
  unique and reachable.
* A name that normalises to nothing (``/``, ``..``) refers to the root and is
  skipped.

Duplicates and file/directory clashes are resolved by the index builder: the
last duplicate wins, and a directory always wins over a file of the same path.
"""

from __future__ import annotations

NAME_MAX = 255
_SHORT_ENOUGH = NAME_MAX // 4  # a str this short cannot exceed NAME_MAX bytes in UTF-8


def normalize(name: str, backslash_is_separator: bool = True) -> str:
    """Return the safe relative path for a member name ('' means the root)."""
    # Fast path: the overwhelming majority of names need no change.
    if (
        len(name) <= _SHORT_ENOUGH
        and ("\\" not in name or not backslash_is_separator)
        and "//" not in name
        and "\x00" not in name
        and not name.startswith(("/", "./", "../"))
        and "/." not in name
        and name not in (".", "..")
    ):
        return name[:-1] if name.endswith("/") else name
    return _normalize_slow(name, backslash_is_separator)


def _normalize_slow(name: str, backslash_is_separator: bool = True) -> str:
    parts: list[str] = []
    for comp in (name.replace("\\", "/") if backslash_is_separator else name).split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if parts:
                parts.pop()
            continue
        if "\x00" in comp:
            comp = comp.replace("\x00", "_")
        parts.append(_fit_component(comp))
    return "/".join(parts)


def _fit_component(comp: str) -> str:
    raw = comp.encode("utf-8", "surrogateescape")
    if len(raw) <= NAME_MAX:
        return comp
    import hashlib  # rare path; hashlib costs ~4 MiB of RSS in the daemon, so only load it here

    digest = hashlib.sha1(raw).hexdigest()[:8]
    head = raw[:240]
    # Do not cut a multi-byte character in half.
    text = head.decode("utf-8", "ignore") if _valid_utf8(raw) else head.decode("utf-8", "surrogateescape")
    return f"{text}~{digest}"


def _valid_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
