"""``python -m cdmlfs`` runs the CLI (tests use it to run the code under test, not an installed copy)."""

import sys

from cdmlfs.cli import main

sys.exit(main())
