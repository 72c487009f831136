"""LRA-style tasks as classification datasets: ListOps' class is the expression's value; generated examples are
padded and masked like labelled files."""

import random

import pytest
import torch

from xscale.config.load import load_config_from_cli
from xscale.config.schema import ConfigError
from xscale.data import build_datasets
from xscale.data.lra import ListOpsClassification


def test_listops_class_is_the_value_digit():
    task = ListOpsClassification(seq_len=64)
    for seed in range(20):
        tokens, label = task.example(random.Random(seed))
        prompt, answer = task.task.example(random.Random(seed))
        assert tokens == prompt and 0 <= label < 10 and task.vocab.pieces[answer[0]] == str(label)


def _config(dataset: str, *extra: str):
    return load_config_from_cli(None, ["model.family=encoder", "train.task=classify", f"data.dataset={dataset}",
                                       "train.seq_len=65", "data.num_samples=64", "data.eval_fraction=0.25", *extra])


def test_pathfinder_for_classify_is_class_token_then_the_whole_image():
    train, evaluation, vocab_size = build_datasets(_config("lra_pathfinder"))
    sample = train[0]
    assert sample["input_ids"].shape == (65,) and sample["padding_mask"].all()
    assert sample["input_ids"][0] == train.task.vocab.bos_id and train.task.size == 8
    assert len(train) == 64 and len(evaluation) == 16 and train.label_names == ["0", "1"] and vocab_size == 9
    assert not torch.equal(evaluation[0]["input_ids"], train[0]["input_ids"])  # a disjoint random stream


def test_listops_for_classify_is_padded_and_masked():
    train, _, _ = build_datasets(_config("lra_listops", "model.pooling=mean", "data.dataset.options={max_depth: 3}"))
    masks = torch.stack([train[i]["padding_mask"] for i in range(16)])
    assert not masks.all() and masks[:, 0].all() and train.num_samples == 64
    assert train.label_names == [str(digit) for digit in range(10)]


def test_lra_datasets_are_refused_for_language_modelling():
    with pytest.raises(ConfigError, match="data.dataset=lra_retrieval holds labelled examples for train.task=classify"):
        load_config_from_cli(None, ["model.family=encoder", "data.dataset=lra_retrieval"])


def test_pad_as_content_drops_the_mask_and_lets_maskless_kinds_train():
    with pytest.raises(ConfigError, match="attention 'linear' takes no key-padding mask.*pad_as_content=true"):
        _config("lra_listops", "model.attention.kind=linear")
    config = _config("lra_listops", "model.attention.kind=linear", "data.dataset.options={pad_as_content: true, max_depth: 3}")
    train, evaluation, _ = build_datasets(config)
    masked, _, _ = build_datasets(_config("lra_listops", "data.dataset.options={max_depth: 3}"))
    assert "padding_mask" not in train[0] and "padding_mask" not in evaluation[0]
    assert torch.equal(train[3]["input_ids"], masked[3]["input_ids"])  # the same tokens: the pads are read
    assert (train[3]["input_ids"] == train.task.vocab.pad_id).any()


def test_pad_as_content_must_be_a_boolean():
    with pytest.raises(ConfigError, match="data.dataset.options.pad_as_content must be true or false, got 'yes'"):
        build_datasets(_config("lra_retrieval", "data.dataset.options={pad_as_content: 'yes'}"))
