"""Relative position encodings that read the queries, keys or values (each registers itself in POSITION)."""

import xscale.models.positions.deberta  # noqa: F401
import xscale.models.positions.learned_frequency  # noqa: F401
import xscale.models.positions.music  # noqa: F401
import xscale.models.positions.shaw  # noqa: F401
import xscale.models.positions.tupe  # noqa: F401
import xscale.models.positions.xl  # noqa: F401
