"""The registered datasets: ``data.dataset`` names one of them (:mod:`.registry`), each a module here that
registers itself; ``data.sources`` corpora are resolved into token files by :mod:`.resolve`."""

# Importing a source module registers it; this order is the order DATASETS and error messages list them in.
# isort: off
import xscale.data.sources.text  # noqa: F401
import xscale.data.sources.synthetic  # noqa: F401
import xscale.data.sources.labeled  # noqa: F401
import xscale.data.sources.lra  # noqa: F401
import xscale.data.sources.images  # noqa: F401

# isort: on
from xscale.data.sources.registry import SOURCES, DatasetSource
from xscale.data.sources.synthetic import TASKS
from xscale.data.sources.text import TEXT_DATASETS

__all__ = ["DATASETS", "SOURCES", "TASKS", "TEXT_DATASETS", "DatasetSource"]

DATASETS = SOURCES.names()
