#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the demo: build a small ImageFolder ZIP, mount it,
# list it, read it with torchvision's ImageFolder, unmount.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python scripts/demo.py
