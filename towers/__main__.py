"""``python -m towers``: see :mod:`towers.cli`."""

import sys

from towers.cli import main

sys.exit(main())
