"""``python -m fp8kit ...``: the ``fp8kit`` command (``fp8kit.cli.main``)."""

import sys

from .cli import main

sys.exit(main())
