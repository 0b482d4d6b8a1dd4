"""``python -m fp8kit.cli ...``: the ``fp8kit`` command (what ``fp8kit train --nproc N`` runs under torchrun)."""

import sys

from . import main

sys.exit(main())
