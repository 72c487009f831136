"""Labelled examples from .jsonl/.tsv: parsing, the label vocabulary, padding, and one-line errors."""

import json

import pytest
import torch

from xscale.data.fixed_vocab import FixedVocab
from xscale.data.labeled import (
    ClassificationDataset,
    encode_examples,
    label_vocabulary,
    read_labeled_examples,
)


def test_a_tsv_header_names_the_columns_in_either_order(tmp_path):
    """LRA's files: `Source<TAB>Target` under a header, text first; a header of our names in either order too."""
    (tmp_path / "lra.tsv").write_text("Source\tTarget\n( MAX 2 9 )\t9\n( MIN 4 1 )\t1\n")
    assert read_labeled_examples(tmp_path / "lra.tsv") == [("( MAX 2 9 )", "9"), ("( MIN 4 1 )", "1")]
    (tmp_path / "named.tsv").write_text("id\ttopic\tbody\n7\tsport\tx\ty\n")  # the last column keeps its tabs
    assert read_labeled_examples(tmp_path / "named.tsv", text_field="body", label_field="topic") == [("x\ty", "sport")]
    (tmp_path / "ours.tsv").write_text("label\ttext\n1\tx y\n")
    assert read_labeled_examples(tmp_path / "ours.tsv") == [("x y", "1")]
    (tmp_path / "short.tsv").write_text("Source\tTarget\nonly text\n")
    with pytest.raises(ValueError, match=r"short.tsv:2 has 1 of the header's 2 tab-separated columns"):
        read_labeled_examples(tmp_path / "short.tsv")


def test_jsonl_and_tsv_give_the_same_examples(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x y", "y": 1}) + "\n\n" + json.dumps({"body": "z", "y": 0}))
    (tmp_path / "a.tsv").write_text("1\tx y\n0\tz\n")
    assert read_labeled_examples(tmp_path / "a.jsonl", "body", "y") == [("x y", "1"), ("z", "0")]
    assert read_labeled_examples(tmp_path / "a.tsv") == [("x y", "1"), ("z", "0")]


def test_label_vocabulary_orders_integers_numerically_then_names():
    assert label_vocabulary(["10", "2", "neg", "2", "-1", "pos"]) == ["-1", "2", "10", "neg", "pos"]


def test_examples_are_class_token_led_cut_and_right_padded():
    vocab = FixedVocab(["a", "b", "c"])
    token_ids, classes = encode_examples([("a b c a", "pos"), ("b", "neg")], vocab, ["neg", "pos"], vocab.bos_id)
    assert classes == [1, 0]
    dataset = ClassificationDataset(token_ids, classes, 4, vocab.pad_id, ["neg", "pos"])
    long, short = dataset[0], dataset[1]
    a, b, c = (vocab.ids[s] for s in "abc")
    assert long["input_ids"].tolist() == [vocab.bos_id, a, b, c] and long["padding_mask"].all()
    assert short["input_ids"].tolist() == [vocab.bos_id, b, vocab.pad_id, vocab.pad_id]
    assert short["padding_mask"].tolist() == [True, True, False, False]
    assert short["labels"].shape == () and short["labels"].dtype == torch.long


def test_a_label_the_model_was_not_trained_on_is_refused():
    vocab = FixedVocab(["a"])
    with pytest.raises(ValueError, match=r"labels \['maybe'\] are not among the 2"):
        encode_examples([("a", "maybe")], vocab, ["neg", "pos"], None)


@pytest.mark.parametrize("name, text, message", [
    ("bad.jsonl", '{"text": "a", "label": 1}\n{"text": "b"\n', r"bad.jsonl:2 is not JSON"),
    ("nofield.jsonl", '{"text": "a"}\n', r"nofield.jsonl:1 has no \"label\" field"),
    ("list.jsonl", '{"text": "a", "label": [1]}\n', r"list.jsonl:1: \"text\" must be a string"),
    ("bad.tsv", "1\ta\nno tab here\n", r"bad.tsv:2 is not label<TAB>text"),
    ("empty.tsv", "\n", r"empty.tsv holds no example"),
    ("data.csv", "1,a\n", r"come in a .jsonl file"),
])
def test_malformed_files_name_the_file_and_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message):
        read_labeled_examples(tmp_path / name)
