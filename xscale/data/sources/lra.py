"""The Long Range Arena-style tasks (:mod:`xscale.data.lra`) for train.task=classify: ``lra_listops``,
``lra_retrieval`` and ``lra_pathfinder``. ``data.dataset.options`` go to the task's generator, except
``pad_as_content`` (the model reads the pads: no padding mask)."""

from __future__ import annotations

from xscale.config.schema import Config, ConfigError
from xscale.data.lra import LRA_TASKS, PAD_AS_CONTENT, GeneratedClassificationDataset
from xscale.data.sources.registry import Built, generated_splits, generator_options, register


def lra_datasets(config: Config, objective: str, label_names: list[str] | None) -> Built:
    """Train and eval examples of the task ``data.dataset`` names, led by the class token with pooling=cls."""
    data, seq_len, seed = config.data, config.train.seq_len, config.train.seed
    cls = config.model.pooling == "cls"
    options = dict(data.dataset.options)
    pad_as_content = options.pop(PAD_AS_CONTENT, False)
    if not isinstance(pad_as_content, bool):
        raise ConfigError(f"data.dataset.options.{PAD_AS_CONTENT} must be true or false, got {pad_as_content!r}")
    try:  # the generator writes seq_len - 1 tokens when the class token leads them
        task = LRA_TASKS[data.dataset.kind.removeprefix("lra_")](seq_len - cls, **options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"data.dataset='{data.dataset}' (data.dataset.options {data.dataset.options}): {error}") from error
    class_token = task.vocab.bos_id if cls else None
    train, evaluation = generated_splits(
        config, lambda num_samples, first_sample: GeneratedClassificationDataset(
            task, seq_len, seed, num_samples, first_sample=first_sample, class_token=class_token,
            pad_as_content=pad_as_content))
    return train, evaluation, task.vocab.vocab_size


register("lra_listops", lra_datasets, (*generator_options(LRA_TASKS["listops"]), PAD_AS_CONTENT),
         "LRA ListOps: an expression's tokens, its value (0-9) the class", tokenized=False, labelled=True)
register("lra_retrieval", lra_datasets, (*generator_options(LRA_TASKS["retrieval"]), PAD_AS_CONTENT),
         "LRA byte-level matching: were two documents written by the same source", tokenized=False, labelled=True)
register("lra_pathfinder", lra_datasets, (*generator_options(LRA_TASKS["pathfinder"]), PAD_AS_CONTENT),
         "LRA Pathfinder: do two dots lie on one dashed curve", tokenized=False, labelled=True)
