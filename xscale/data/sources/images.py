"""``images_shapes`` (:mod:`xscale.data.lra.shapes`): images of model.image_size and model.image_channels, one
shape each, its kind the class, for train.task=classify. No vocabulary."""

from __future__ import annotations

from xscale.config.schema import Config, ConfigError
from xscale.data.lra import GeneratedImageDataset, ShapesTask
from xscale.data.sources.registry import Built, data_options, generated_splits, generator_options, register

SHAPES_OPTIONS = generator_options(ShapesTask, leading=2)  # after the image's size and channels: noise


def shapes_datasets(config: Config, objective: str, label_names: list[str] | None) -> Built:
    """Train and eval images; data.dataset.options: ``noise`` (the pixel noise's standard deviation)."""
    data, model = config.data, config.model
    try:
        task = ShapesTask(model.image_size, model.image_channels, **data_options(config, SHAPES_OPTIONS))
    except (TypeError, ValueError) as error:
        raise ConfigError(f"data.dataset='{data.dataset}' (data.dataset.options {data.dataset.options}): {error}") from error
    train, evaluation = generated_splits(
        config, lambda num_samples, first_sample: GeneratedImageDataset(task, config.train.seed, num_samples,
                                                                        first_sample=first_sample))
    return train, evaluation, 0


register("images_shapes", shapes_datasets, SHAPES_OPTIONS,
         "generated images of one shape each (its kind the class), for a ViT", tokenized=False, labelled=True)
