"""``python -m grserve`` — same as the ``grserve`` command."""

import sys

from grserve.cli import main

sys.exit(main())
