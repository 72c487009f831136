"""The procedural shapes task: deterministic by (seed, index), each class its shape, a disjoint eval stream."""

import torch

from xscale.config.load import load_config_from_cli
from xscale.data import build_datasets
from xscale.data.datasets import sample_rng
from xscale.data.lra.shapes import SHAPES, ShapesTask, shape_mask


def test_the_same_seed_and_index_give_the_same_image_and_others_differ():
    task = ShapesTask(16, 3)
    first, label = task.example(sample_rng(7, 3))
    again, label_again = task.example(sample_rng(7, 3))
    other, _ = task.example(sample_rng(7, 4))
    assert first.shape == (3, 16, 16) and first.dtype == torch.float32
    assert torch.equal(first, again) and label == label_again and not torch.equal(first, other)
    assert not torch.equal(first, task.example(sample_rng(8, 3))[0])


def test_each_shape_is_drawn_as_described():
    """On a 7x7 grid, half-width 3 at the centre: the masks a person would draw."""
    masks = {shape: shape_mask(shape, 7, (3.0, 3.0), 3.0) for shape in SHAPES}
    assert masks["square"].all()
    assert not masks["circle"][0, 0] and masks["circle"][0, 3] and masks["circle"][3].all()
    assert masks["triangle"][0].tolist() == [False, False, False, True, False, False, False]  # the apex
    assert masks["triangle"][6].all() and masks["triangle"].sum() == 1 + 1 + 3 + 3 + 5 + 5 + 7
    assert masks["cross"][3].all() and masks["cross"][:, 3].all() and masks["cross"].sum() == 2 * 7 * 3 - 3 * 3  # arms 3 wide (half-width 1)


def test_classes_are_balanced_and_the_shape_is_brighter_than_its_background():
    task = ShapesTask(16, 1, noise=0.0)
    labels = []
    for index in range(400):
        pixels, label = task.example(sample_rng(0, index))
        labels.append(label)
        assert len(pixels.unique()) == 2  # one shape colour and one background colour without noise
    counts = torch.bincount(torch.tensor(labels), minlength=4)
    assert counts.min() > 70, counts


def test_images_shapes_dataset_carries_pixels_and_a_disjoint_eval_split():
    config = load_config_from_cli(None, [
        "model.family=encoder", "train.task=classify", "data.dataset=images_shapes", "model.input=patches",
        "train.seq_len=17", "model.position=learned", "data.num_samples=32", "data.eval_fraction=0.25"])
    train, evaluation, _ = build_datasets(config)
    sample = train[0]
    assert set(sample) == {"pixels", "labels"} and sample["pixels"].shape == (3, 16, 16)
    assert len(train) == 32 and len(evaluation) == 8 and train.label_names == list(SHAPES)
    assert not torch.equal(evaluation[0]["pixels"], train[0]["pixels"])
    assert torch.equal(build_datasets(config)[0][5]["pixels"], train[5]["pixels"])
