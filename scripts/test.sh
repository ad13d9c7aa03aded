#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite against real FUSE mounts.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check cdmlfs cdmlfs_torch tests scripts
# CDMLFS_STRICT_SKIPS=1: a skip for a missing tool or package fails (tests/conftest.py says which pass).
CDMLFS_REQUIRE_NATIVE=1 CDMLFS_STRICT_SKIPS=1 .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
