"""Shared fixtures: real mounts under tmp_path that are always unmounted."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from mountutil import force_unmount, is_mounted


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fuse: needs /dev/fuse and fusermount")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    # Indexes, logs and mount-point locks that tests do not place themselves go to a directory of
    # this run (children inherit it), not into the user's ~/.cache and ~/.local/state.
    scratch = Path(tempfile.mkdtemp(prefix="cdmlfs-tests-xdg-"))
    config._cdmlfs_xdg = scratch  # type: ignore[attr-defined]
    os.environ["XDG_CACHE_HOME"] = str(scratch / "cache")
    os.environ["XDG_STATE_HOME"] = str(scratch / "state")


def pytest_unconfigure(config: pytest.Config) -> None:
    scratch = getattr(config, "_cdmlfs_xdg", None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


# Skips that depend on the machine, not on what setup installed: no GPU, memory taken by others,
# not root, one core, no mount namespaces (a container). With CDMLFS_STRICT_SKIPS=1 (scripts/test.sh)
# any other skip fails: a tool or package the setup did not install must not quietly drop coverage.
ALLOWED_SKIPS = (
    "CUDA",
    "of available memory",
    "of free memory",
    "needs root",
    "two cores",
    "cannot create mount namespaces",
)


def _fail_unexpected_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not report.skipped or os.environ.get("CDMLFS_STRICT_SKIPS") != "1" or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(allowed in reason for allowed in ALLOWED_SKIPS):
        report.outcome = "failed"
        report.longrepr = f"skipped on a machine that scripts/setup.sh prepared: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())  # a module-level importorskip


def fuse_available() -> bool:
    return os.path.exists("/dev/fuse") and bool(shutil.which("fusermount3") or shutil.which("fusermount"))


@pytest.fixture
def mnt(tmp_path: Path):
    """An empty mount point; whatever gets mounted on it is unmounted at teardown."""
    if not fuse_available():
        pytest.skip("FUSE is not available (need /dev/fuse and fusermount3)")
    path = tmp_path / "mnt"
    path.mkdir()
    yield path
    if is_mounted(path):
        force_unmount(path)


@pytest.fixture(params=["1", "0"], ids=["c-fast-path", "python-path"])
def both_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs twice: with the C fast path, and with every request served in Python."""
    monkeypatch.setenv("CDMLFS_FASTPATH", request.param)
    return request.param
