"""Name -> dataset source: ``data.dataset`` names a registered source, whose builder makes the run's datasets.

A source module registers each of its names with :func:`register` (builder, the ``data.dataset.options`` it reads, a
one-line description); every module of :mod:`xscale.data.sources` is imported by the package itself, so the
registry read through it is complete. Adding a dataset is one module there plus its test.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch.utils.data import Dataset

from xscale.config.schema import Config, ConfigError

# (train dataset, eval dataset or None, vocabulary size the model needs)
Built = tuple[Dataset, Dataset | None, int]
# builder(config, objective, label names of a trained classifier or None)
Builder = Callable[[Config, str, list[str] | None], Built]
DEFAULT_TASK_SAMPLES = 100_000


@dataclass(frozen=True)
class DatasetSource:
    """A registered dataset: its builder, the ``data.dataset.options`` it reads and what it is, in one line."""

    name: str
    build: Builder
    options: tuple[str, ...]
    description: str
    tokenized: bool  # reads text through the run's tokenizer (False: a built-in vocabulary, or pixels)
    labelled: bool = False  # labelled examples, for train.task=classify
    text: bool = False  # windows of a text corpus (the pre-training objectives; data.sources blends corpora)


class DatasetRegistry:
    """The registered sources, in registration order (the order error messages and ``DATASETS`` list them)."""

    def __init__(self) -> None:
        self._sources: dict[str, DatasetSource] = {}

    def add(self, source: DatasetSource) -> DatasetSource:
        if source.name in self._sources:
            raise KeyError(f"dataset '{source.name}' is registered twice")
        self._sources[source.name] = source
        return source

    def get(self, name: str) -> DatasetSource:
        if name not in self._sources:
            raise ConfigError(f"data.dataset='{name}' is not one of {', '.join(self.names())}")
        return self._sources[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._sources)

    def __contains__(self, name: str) -> bool:
        return name in self._sources


SOURCES = DatasetRegistry()


def register(name: str, build: Builder, options: tuple[str, ...], description: str, tokenized: bool = True,
             labelled: bool = False, text: bool = False) -> DatasetSource:
    return SOURCES.add(DatasetSource(name, build, options, description, tokenized, labelled, text))


def generator_options(generator: type, leading: int = 1) -> tuple[str, ...]:
    """The keyword options of a task generator's constructor: its parameters after the ``leading`` ones that the
    run fixes (the sequence length; an image's size and channels)."""
    return tuple(inspect.signature(generator).parameters)[leading:]


def data_options(config: Config, allowed: tuple[str, ...]) -> dict:
    """``data.dataset.options``, refused when one is not among ``allowed``."""
    unknown = sorted(set(config.data.dataset.options) - set(allowed))
    if unknown:
        raise ConfigError(f"data.dataset.options {unknown} are not options of data.dataset='{config.data.dataset}' with this "
                          f"objective; allowed: {', '.join(allowed) or 'none'}")
    return dict(config.data.dataset.options)


def generated_splits(config: Config, make: Callable[[int, int], Dataset]) -> tuple[Dataset, Dataset | None]:
    """Train and eval splits of a generated dataset: ``make(num_samples, first_sample)``. Eval examples continue
    the global index past the training ones: disjoint random streams."""
    num_samples = config.data.num_samples or DEFAULT_TASK_SAMPLES
    eval_samples = round(num_samples * config.data.eval_fraction)
    return make(num_samples, 0), make(eval_samples, num_samples) if eval_samples else None


@contextlib.contextmanager
def user_file(key: str) -> Iterator[None]:
    """A missing, unreadable or corrupt file a config key names, as one ConfigError naming the key."""
    try:
        yield
    except ConfigError:
        raise
    except (OSError, ValueError, ImportError) as error:
        raise ConfigError(f"{key}: {error}") from error
