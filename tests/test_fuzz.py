"""Fuzzing in the test suite: saved findings replay cleanly, seeds read whole, short coverage-guided runs.

The long runs are ``scripts/fuzz.py --total 1000000``; here each parser gets a
few thousand coverage-guided inputs with a fixed seed (seconds), so a change
that makes a parser raise an undocumented exception, read short or hang is
caught before it lands. Every input that ever broke the contract is kept under
``tests/fuzz/regressions/<target>/`` (with a ``.txt`` note naming the bug) and
replayed here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fuzz import harness, seeds

ROOT = Path(__file__).resolve().parent.parent
REGRESSIONS = Path(__file__).parent / "fuzz" / "regressions"
CASES = sorted(p for p in REGRESSIONS.glob("*/*") if p.is_file() and p.suffix != ".txt")


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level("CRITICAL")
    yield
    harness.cleanup()


@pytest.mark.parametrize("case", CASES, ids=[f"{p.parent.name}/{p.name[:20]}" for p in CASES])
def test_saved_finding_replays_cleanly(case: Path) -> None:
    harness.run(case.parent.name, case.read_bytes(), seconds=30)


def test_every_saved_finding_has_a_note() -> None:
    missing = [p.name for p in CASES if not p.with_name(p.name + ".txt").exists()]
    assert not missing, f"regression cases without a note saying which bug they caught: {missing}"


@pytest.mark.parametrize("target", sorted(seeds.SEEDS))
def test_seeds_open_and_read_through_both_sources(target: str) -> None:
    """The seeds are valid archives: they open (not refused) from memory and from a file."""
    for name, data in seeds.SEEDS[target]().items():
        if target == "index":
            harness.run(target, data, seconds=30)
            continue
        with harness.memory_index_store():
            for file_backed in (False, True):
                assert harness.open_and_exercise(data, file_backed), f"{target} seed {name} was refused"


def test_the_harness_reports_undocumented_exceptions_and_short_reads(monkeypatch) -> None:
    """The harness itself: a parser bug must surface, not be swallowed."""
    from cdmlfs.reader import ExtentReader

    data = seeds.zip_seeds()["deflated"]
    real = ExtentReader.read
    monkeypatch.setattr(ExtentReader, "read", lambda self, e, o, s: real(self, e, o, s)[:-1] or b"")
    with pytest.raises(harness.InvariantError):
        harness.run("zip", data)
    monkeypatch.setattr(ExtentReader, "read", lambda self, e, o, s: [][1])
    with pytest.raises(IndexError):
        harness.run("zip", data)


def test_time_limit_interrupts_a_hang() -> None:
    import time

    with pytest.raises(harness.InputTimeout), harness.time_limit(0.2):
        time.sleep(5)


def _short_run(tmp_path: Path, target: str, runs: int, engine: str) -> dict:
    cmd = [
        sys.executable, str(ROOT / "scripts" / "fuzz.py"), "--target", target, "--runs", str(runs),
        "--seed", "7", "--engine", engine, "--corpus", str(tmp_path / "corpus"), "--timeout", "20",
        "--max-findings", "3",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "corpus" / "report.json").read_text())[-1]
    result = report["targets"][target]
    assert not result["findings"], f"fuzzing {target} found: {result['findings']}\n{res.stdout[-4000:]}"
    assert res.returncode == 0, res.stderr[-3000:]
    assert result["inputs"] >= runs
    return result


@pytest.mark.parametrize(("target", "runs"), [("zip", 4000), ("tar", 4000), ("zstd", 1500), ("index", 1500)])
def test_short_coverage_guided_run(target: str, runs: int, tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    result = _short_run(tmp_path, target, runs, "atheris")
    assert result["coverage_edges"], "atheris reported no coverage: instrumentation is off"


def test_short_mutation_run_all_targets(tmp_path: Path) -> None:
    """The plain mutation engine (no atheris needed) over every target."""
    for target in sorted(seeds.SEEDS):
        _short_run(tmp_path / target, target, 1500, "random")
