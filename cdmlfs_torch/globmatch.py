"""Shell-style globs over ``/``-separated relative paths, with ``**`` across directories.

``fnmatch`` lets ``*`` cross ``/`` and ``PurePath.match`` (before 3.13) has no
recursive ``**``; selection of samples inside an archive wants neither surprise:
``*`` stays in one path segment, ``**/`` spans zero or more directories,
``?`` is one character, ``[...]`` a character class (``[!...]`` negated).
Matching is case-sensitive, like paths in an archive.
"""

from __future__ import annotations

import functools
import re


@functools.lru_cache(maxsize=64)
def compile_glob(pattern: str) -> re.Pattern[str]:
    """A compiled regular expression that matches exactly the paths ``pattern`` matches."""
    out = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":  # a leading ']' is a literal member of the class
                j += 1
            end = pattern.find("]", j)
            if end < 0:
                out.append(re.escape(c))
                i += 1
                continue
            body = pattern[i + 1 : end]
            negate = body.startswith("!")
            if negate:
                body = body[1:]
            body = body.replace("\\", "\\\\").replace("^", "\\^").replace("[", "\\[").replace("]", "\\]")
            out.append(("[^/" if negate else "[") + body + "]")
            i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL)


def glob_match(path: str, pattern: str) -> bool:
    """Whether the relative ``path`` matches ``pattern`` as a whole (not a suffix of it)."""
    return compile_glob(pattern).match(path) is not None
