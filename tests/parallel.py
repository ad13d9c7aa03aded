"""Test helper: run a worker in several threads at once and collect what they raised."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


def run_in_threads(worker: Callable[..., object], args: Iterable[tuple]) -> list[BaseException]:
    """``worker(*a)`` in one thread per ``a``, all started before any is joined; the exceptions
    (failed asserts included) they raised, for the test to report in its own thread."""
    errors: list[BaseException] = []

    def guarded(*a) -> None:
        try:
            worker(*a)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
