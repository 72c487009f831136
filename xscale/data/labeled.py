"""Labelled examples for sequence classification (``train.task=classify``), read from the user's file.

``.jsonl``: one object per line, the text under ``data.text_field`` and the label under ``data.label_field``;
``.tsv``: one ``label<TAB>text`` per line, or any column order under a header line that names the columns
(``data.label_field`` / ``data.text_field``, or the common names: LRA's ``Source<TAB>Target`` reads as text, label).
The label vocabulary is the sorted set of labels in the data (saved in
each checkpoint's meta.json, so evaluation maps labels to the same classes). Each example is tokenized, led by the
class token when the model pools it (``model.pooling=cls``), cut to ``train.seq_len`` and padded on the right with
the pad id; ``padding_mask`` marks its real tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

LabeledExample = tuple[str, str]  # (text, label)
FORMATS = (".jsonl", ".tsv")
LABELS_META_KEY = "labels"  # a classifier checkpoint's meta.json: its label vocabulary, class index order


def read_labeled_examples(path: str | Path, text_field: str = "text", label_field: str = "label"
                          ) -> list[LabeledExample]:
    """Every (text, label) of a .jsonl or .tsv file; a malformed line is a ValueError naming the file and line."""
    path = Path(path)
    if path.suffix not in FORMATS:
        raise ValueError(f"{path}: labelled examples come in a .jsonl file ({{\"{text_field}\": ..., "
                         f"\"{label_field}\": ...}} per line) or a .tsv file (label<TAB>text per line)")
    examples = []
    columns = None  # a .tsv header's (text, label, column count)
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            if path.suffix == ".tsv" and not examples and columns is None:
                if (columns := tsv_header(line, text_field, label_field)) is not None:
                    continue
            example = (_jsonl_example(line, where, text_field, label_field) if path.suffix == ".jsonl"
                       else _tsv_example(line, where, columns))
            examples.append(example)
    if not examples:
        raise ValueError(f"{path} holds no example")
    return examples


def _jsonl_example(line: str, where: str, text_field: str, label_field: str) -> LabeledExample:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not JSON ({error.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} is not a JSON object")
    for field in (text_field, label_field):
        if field not in record:
            raise ValueError(f"{where} has no \"{field}\" field (data.text_field / data.label_field name the fields)")
    text, label = record[text_field], record[label_field]
    if not isinstance(text, str) or isinstance(label, (dict, list, float)) or label is None:
        raise ValueError(f"{where}: \"{text_field}\" must be a string and \"{label_field}\" a string, integer or "
                         "boolean")
    return text, str(label)


LABEL_COLUMNS = ("label", "target", "class", "labels")
TEXT_COLUMNS = ("text", "source", "sentence", "input")


def tsv_header(line: str, text_field: str = "text", label_field: str = "label") -> tuple[int, int, int] | None:
    """(text column, label column, column count) when ``line`` is a header naming both columns, else None."""
    names = [name.strip().lower() for name in line.rstrip("\r\n").split("\t")]
    label = next((names.index(name) for name in (label_field.lower(), *LABEL_COLUMNS) if name in names), None)
    text = next((names.index(name) for name in (text_field.lower(), *TEXT_COLUMNS) if name in names), None)
    if label is None or text is None or label == text:
        return None
    return text, label, len(names)


def _tsv_example(line: str, where: str, columns: tuple[int, int, int] | None = None) -> LabeledExample:
    if columns is None:
        label, tab, text = line.rstrip("\r\n").partition("\t")
        if not tab or not label.strip():
            raise ValueError(f"{where} is not label<TAB>text (or give a header line naming the columns)")
        return text, label.strip()
    text_column, label_column, count = columns
    fields = line.rstrip("\r\n").split("\t", count - 1)  # the last column keeps any tab of its own
    if len(fields) != count or not fields[label_column].strip():
        raise ValueError(f"{where} has {len(fields)} of the header's {count} tab-separated columns")
    return fields[text_column], fields[label_column].strip()


def label_vocabulary(labels: Sequence[str]) -> list[str]:
    """The distinct labels, integers in numeric order first, then the rest alphabetically."""
    return sorted(set(labels), key=lambda label: (0, int(label), "") if _is_integer(label) else (1, 0, label))


def _is_integer(label: str) -> bool:
    return label.lstrip("-").isdigit()


class ClassificationDataset(torch.utils.data.Dataset):
    """Tokenized examples, each ``{"input_ids": (T,), "padding_mask": (T,), "labels": ()}`` (the class index)."""

    def __init__(self, token_ids: list[list[int]], classes: list[int], seq_len: int, pad_id: int,
                 label_names: list[str]) -> None:
        if len(token_ids) != len(classes):
            raise ValueError(f"{len(token_ids)} token sequences but {len(classes)} labels")
        self.token_ids, self.classes, self.seq_len, self.pad_id = token_ids, classes, seq_len, pad_id
        self.label_names = label_names

    @property
    def num_classes(self) -> int:
        return len(self.label_names)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return classification_sample(self.token_ids[index], self.classes[index], self.seq_len, self.pad_id)


def classification_sample(tokens: list[int], label: int, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One example cut to ``seq_len`` and right-padded: input_ids, padding_mask (True at real tokens), labels."""
    tokens = tokens[:seq_len]
    padding = seq_len - len(tokens)
    return {"input_ids": torch.tensor(tokens + [pad_id] * padding, dtype=torch.long),
            "padding_mask": torch.tensor([True] * len(tokens) + [False] * padding),
            "labels": torch.tensor(label, dtype=torch.long)}


def encode_examples(examples: Sequence[LabeledExample], tokenizer, label_names: list[str],
                    class_token: int | None) -> tuple[list[list[int]], list[int]]:
    """(token ids, class indices) of ``examples``; ``class_token`` (if any) leads each sequence."""
    index = {label: position for position, label in enumerate(label_names)}
    unknown = sorted({label for _, label in examples} - set(index))
    if unknown:
        raise ValueError(f"labels {unknown[:5]} are not among the {len(label_names)} the model was trained on "
                         f"({', '.join(label_names[:10])})")
    lead = [] if class_token is None else [class_token]
    token_ids = []
    for text, _ in examples:
        ids = lead + tokenizer.encode(text)
        if not ids:
            ids = [tokenizer.pad_id]  # an empty text still has one real position to pool
        token_ids.append(ids)
    return token_ids, [index[label] for _, label in examples]
