"""``python -m workers`` is ``areal-async``."""

import sys

from workers.cli import main

sys.exit(main())
