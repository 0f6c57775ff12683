"""``python -m flaggems`` runs the command line (see :mod:`flaggems.cli`)."""

import sys

from flaggems.cli import main

sys.exit(main())
