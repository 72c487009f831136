"""``labeled``: classification examples read from ``data.path`` (.jsonl or .tsv, :mod:`xscale.data.labeled`) for
train.task=classify, the last ``data.eval_fraction`` of them held out for evaluation."""

from __future__ import annotations

from xscale.config.schema import Config, ConfigError
from xscale.data.labeled import (
    ClassificationDataset,
    encode_examples,
    label_vocabulary,
    read_labeled_examples,
)
from xscale.data.sources.registry import Built, data_options, register, user_file
from xscale.data.sources.run_tokenizer import build_tokenizer


def labeled_datasets(config: Config, objective: str, label_names: list[str] | None) -> Built:
    """Examples of data.path; ``label_names``: a trained classifier's classes (None: the labels in the data)."""
    data = config.data
    if not data.path:
        raise ConfigError("data.dataset=labeled needs data.path: a .jsonl ({\"text\": ..., \"label\": ...} per line) "
                          "or .tsv (label<TAB>text per line) file")
    data_options(config, ())
    with user_file("data.path"):
        examples = read_labeled_examples(data.path, data.text_field, data.label_field)
    names = label_names or label_vocabulary([label for _, label in examples])
    if len(names) < 2:
        raise ConfigError(f"data.path={data.path} holds one label ({names[0]}); classification needs at least two")
    tokenizer = build_tokenizer(config, [text for text, _ in examples])
    class_token = tokenizer.bos_id if config.model.pooling == "cls" else None
    if config.model.pooling == "cls" and class_token is None:
        raise ConfigError("model.pooling=cls prepends the tokenizer's <s> as the class token, but data.tokenizer has "
                          "none; use model.pooling=mean or a tokenizer with a bos token")
    with user_file("data.path"):
        token_ids, classes = encode_examples(examples, tokenizer, names, class_token)
    held_out = round(len(examples) * data.eval_fraction)
    if len(examples) - held_out < 1:
        raise ConfigError(f"data.path={data.path} holds {len(examples)} examples, none left to train on after "
                          f"data.eval_fraction={data.eval_fraction}")
    kept = len(examples) - held_out
    pad_id, seq_len = tokenizer.pad_id, config.train.seq_len
    train = ClassificationDataset(token_ids[:kept], classes[:kept], seq_len, pad_id, names)
    evaluation = (ClassificationDataset(token_ids[kept:], classes[kept:], seq_len, pad_id, names)
                  if held_out else None)
    return train, evaluation, tokenizer.vocab_size


register("labeled", labeled_datasets, (),
         "data.path: labelled examples (.jsonl text/label fields, or .tsv label<TAB>text) for train.task=classify",
         labelled=True)
