"""The synthetic tasks (:mod:`xscale.data.tasks`): copy, associative recall and ListOps, generated per global
sample index for a pre-training objective over their built-in vocabularies. ``data.dataset.options`` go to the task's
generator."""

from __future__ import annotations

from xscale.config.schema import Config, ConfigError
from xscale.data.datasets import TaskDataset
from xscale.data.sources.registry import Built, data_options, generated_splits, generator_options, register
from xscale.data.tasks import AssociativeRecallTask, CopyTask, ListOpsTask

TASKS = {"copy": CopyTask, "assoc_recall": AssociativeRecallTask, "listops": ListOpsTask}


def task_datasets(config: Config, objective: str, label_names: list[str] | None) -> Built:
    """Train and eval examples of the task ``data.dataset`` names."""
    data, seq_len, seed = config.data, config.train.seq_len, config.train.seed
    generator = TASKS[data.dataset.kind]
    options = data_options(config, generator_options(generator))
    try:
        task = generator(seq_len, **options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"data.dataset='{data.dataset}': {error}") from error
    train, evaluation = generated_splits(
        config, lambda num_samples, first_sample: TaskDataset(task, objective, seq_len, seed, num_samples,
                                                              first_sample=first_sample))
    return train, evaluation, task.vocab.vocab_size


register("copy", task_datasets, generator_options(CopyTask),
         "copy a random symbol sequence after a separator", tokenized=False)
register("assoc_recall", task_datasets, generator_options(AssociativeRecallTask),
         "associative recall: key-value pairs, then a key whose value to answer", tokenized=False)
register("listops", task_datasets, generator_options(ListOpsTask),
         "ListOps: nested list operations on digits, the answer digit to predict", tokenized=False)
