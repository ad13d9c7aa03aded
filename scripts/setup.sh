#!/usr/bin/env bash
# Install everything cdmlfs needs on a fresh Debian/Ubuntu machine, into ./.venv.
#   system: fuse3 + libfuse2 (FUSE user space; libfuse2 is the fallback the tests also mount with),
#           libdeflate/zlib/zstd/xxhash/isa-l + pkg-config + Python headers (C builds), python3-venv where
#           Debian splits it out, zip/unzip/zstd, bsdtar (libarchive-tools) and 7z (p7zip-full): test
#           fixtures from real producers and reference extraction; strace (a test watches syscalls)
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
APT_PACKAGES=(fuse3 libfuse2 libfuse3-dev pkg-config gcc libdeflate-dev zlib1g-dev libzstd-dev libxxhash-dev libisal-dev
              zip unzip zstd tar util-linux strace libarchive-tools p7zip-full)
# Debian splits venv's pip bootstrap (python3-venv) and the C headers (python3-dev) out of python3.
"$PY" -c "import ensurepip, venv" >/dev/null 2>&1 || APT_PACKAGES+=(python3-venv)
"$PY" -c "import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
  || APT_PACKAGES+=(python3-dev)
# Installed, not merely known to dpkg (a removed package leaves its configuration behind).
installed() {
  case "$(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null)" in ii*) return 0 ;; esac
  return 1
}
missing=()
for p in "${APT_PACKAGES[@]}"; do
  # Ubuntu 24.04 and Debian 13 renamed libfuse2 to libfuse2t64 (apt-get install libfuse2 picks it).
  if [ "$p" = libfuse2 ] && installed libfuse2t64; then continue; fi
  installed "$p" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing system packages: ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
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
