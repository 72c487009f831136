"""``python -m xscale ...`` (what torchrun runs: ``torchrun --nproc-per-node N -m xscale train ...``)."""

import sys

from xscale.cli import main

sys.exit(main())
