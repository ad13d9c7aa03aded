#!/usr/bin/env bash
# Install everything cdmlfs needs on a fresh Debian/Ubuntu machine, into ./.venv.
#   system: fuse3 + libfuse2 (FUSE user space), libdeflate/zlib/zstd/xxhash + pkg-config + Python
#           headers (C builds), python3-venv where Debian splits it out,
#           zip/unzip/zstd (test fixtures and reference extraction), strace (a test watches syscalls)
#   python: torch 2.14.1 + torchvision 0.29.1 (pinned), cdmlfs in editable mode with test extras
# Usage: scripts/setup.sh [--no-torch]
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_TORCH=1
for arg in "$@"; do
  case "$arg" in
    --no-torch) WITH_TORCH=0 ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
APT_PACKAGES=(fuse3 libfuse2 libfuse3-dev pkg-config gcc libdeflate-dev zlib1g-dev libzstd-dev libxxhash-dev
              zip unzip zstd tar util-linux strace)
# Debian splits venv's pip bootstrap (python3-venv) and the C headers (python3-dev) out of python3.
"$PY" -c "import ensurepip, venv" >/dev/null 2>&1 || APT_PACKAGES+=(python3-venv)
"$PY" -c "import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
  || APT_PACKAGES+=(python3-dev)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing system packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# A .venv left by an earlier failed run (no pip in it) is made again.
if [ -x .venv/bin/python ] && ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  rm -rf .venv
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
if [ "$WITH_TORCH" = 1 ]; then
  .venv/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
fi
# CDMLFS_REQUIRE_NATIVE=1: fail loudly here if the C accelerator cannot be built.
CDMLFS_REQUIRE_NATIVE=1 .venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/cdmlfs doctor
