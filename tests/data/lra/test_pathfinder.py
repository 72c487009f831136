"""Pathfinder images: deterministic by seed, balanced, two dots on the ends of one curve exactly when labelled 1."""

import random

from xscale.data.lra.pathfinder import DOT, PathfinderTask


def test_images_are_deterministic_flattened_and_balanced():
    task = PathfinderTask(seq_len=256)
    assert task.size == 16
    examples = [task.example(random.Random(seed)) for seed in range(100)]
    assert examples == [PathfinderTask(seq_len=256).example(random.Random(seed)) for seed in range(100)]
    assert all(len(tokens) == 256 for tokens, _ in examples)
    assert 0.35 < sum(label for _, label in examples) / 100 < 0.65


def test_the_dots_end_one_curve_exactly_when_connected():
    task = PathfinderTask(seq_len=256)
    for seed in range(50):
        pixels, label, ends = task.image(random.Random(seed))
        dots = {(r, c) for r, row in enumerate(pixels) for c, value in enumerate(row) if value == DOT}
        assert dots <= set(ends[0]) | set(ends[1])
        assert (dots == set(ends[0])) == bool(label) or ends[0][0] == ends[0][1]
