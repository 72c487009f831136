"""data.sources (:mod:`xscale.data.sources.resolve`): text, jsonl (any text field) and indexed corpora as token
files, eval_sources for evaluation, and bad entries refused in one line naming data.sources[i]."""

from __future__ import annotations

import numpy as np
import pytest

from tests.data.conftest import lines, write_jsonl
from xscale.config.load import load_config
from xscale.config.schema import ConfigError
from xscale.data import build_datasets
from xscale.data.datasets import ArrayTokens, PackedTextDataset, tokenize_documents
from xscale.data.indexed import IndexedTokens
from xscale.data.load_tokenizer import load_tokenizer
from xscale.data.preprocess import tokenize_to_indexed

TINY = ["model.vocab_size=96", "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "train.global_batch_size=4",
        "train.seq_len=8", "data.dataset=text"]


def _config(tmp_path, hf_tokenizer, sources: str, *extra: str):
    return load_config(None, [*TINY, f"train.output_dir={tmp_path / 'run'}", f"data.tokenizer={hf_tokenizer}",
                              f"data.sources={sources}", *extra])


def _tokens(dataset) -> set[int]:
    return {int(token) for i in range(len(dataset)) for token in dataset[i]["input_ids"]}


def test_a_jsonl_source_reads_the_configured_text_field(tmp_path, hf_tokenizer):
    texts = lines(30)
    write_jsonl(tmp_path / "docs.jsonl", texts, field="body")
    config = _config(tmp_path, hf_tokenizer, f"[{{path: {tmp_path / 'docs.jsonl'}}}]", "data.text_field=body",
                     "data.eval_fraction=0")
    train, evaluation, _ = build_datasets(config)
    assert evaluation is None and train.source_names == ["docs"]
    cached = IndexedTokens(next((tmp_path / "run" / "data_cache").glob("docs-*.idx")).with_suffix(""))
    tokenizer = load_tokenizer(hf_tokenizer)
    expected = [token for text in texts for token in tokenizer.encode(text) + [tokenizer.eos_id]]
    assert cached.read(0, len(cached)).tolist() == expected
    with pytest.raises(ConfigError, match=r"data.sources\[0\].*docs.jsonl:1 .* \"text\" field"):
        build_datasets(_config(tmp_path / "default", hf_tokenizer, f"[{{path: {tmp_path / 'docs.jsonl'}}}]"))


def test_eval_sources_are_what_evaluation_reads(tmp_path, hf_tokenizer):
    tokenizer = load_tokenizer(hf_tokenizer)
    train_text = "\n".join(lines(40))
    (tmp_path / "train.txt").write_text(train_text)
    # The held-out corpus uses one word only: its tokens are a small set the training text mostly lacks.
    (tmp_path / "heldout.txt").write_text(" ".join(["omega"] * 400))
    config = _config(tmp_path, hf_tokenizer, f"[{{path: {tmp_path / 'train.txt'}}}]",
                     f"data.eval_sources=[{{path: {tmp_path / 'heldout.txt'}, name: heldout}}]")
    train, evaluation, _ = build_datasets(config)
    assert evaluation.source_names == ["heldout"]
    assert _tokens(evaluation) <= set(tokenizer.encode("omega omega")) | {tokenizer.eos_id}
    assert len(train) == len(train.datasets[0])  # no windows held out of the training corpus
    assert _tokens(train) - _tokens(evaluation)


def test_an_indexed_source_is_read_where_it_lies(tmp_path, hf_tokenizer):
    prefix = tmp_path / "tokens"
    tokenize_to_indexed(lines(30), hf_tokenizer, prefix)
    config = _config(tmp_path, hf_tokenizer, f"[{{path: {prefix}, kind: indexed}}, {{path: {prefix}, weight: 2}}]")
    train, _, _ = build_datasets(config)
    assert train.source_names == ["tokens", "tokens_2"]
    assert not (tmp_path / "run" / "data_cache").exists()  # nothing tokenized
    assert np.bincount(train.source_index).tolist()[1] == pytest.approx(2 * len(train) / 3, abs=1)


def test_a_text_source_is_tokenized_once_and_again_when_it_changes(tmp_path, hf_tokenizer):
    corpus = tmp_path / "web.txt"
    corpus.write_text("\n".join(lines(30)))
    sources = f"[{{path: {corpus}}}]"
    build_datasets(_config(tmp_path, hf_tokenizer, sources))
    (cached,) = (tmp_path / "run" / "data_cache").glob("*.bin")
    built = cached.stat().st_mtime_ns
    build_datasets(_config(tmp_path, hf_tokenizer, sources))
    assert cached.stat().st_mtime_ns == built
    corpus.write_text("\n".join(lines(31)))
    build_datasets(_config(tmp_path, hf_tokenizer, sources))
    assert len(list((tmp_path / "run" / "data_cache").glob("*.bin"))) == 2


@pytest.mark.parametrize(("entry", "message"), [
    ("{path: MISSING}", r"^data.sources\[1\].path=.*missing.txt does not exist"),
    ("{path: OK, weight: 0}", r"^data.sources\[1\].weight must be a positive number, got 0"),
    ("{path: OK, weight: -2}", r"^data.sources\[1\].weight must be a positive number, got -2"),
    ("{path: OK, kind: parquet}", r"^data.sources\[1\].kind='parquet' is not one of auto, text, jsonl, indexed"),
    ("{path: OK, wieght: 2}", r"^unknown key 'data.sources\[1\].wieght' \(did you mean 'weight'\?\)"),
])
def test_a_bad_source_is_one_line_naming_its_entry(tmp_path, hf_tokenizer, entry, message):
    (tmp_path / "ok.txt").write_text("\n".join(lines(30)))
    entry = entry.replace("MISSING", str(tmp_path / "missing.txt")).replace("OK", str(tmp_path / "ok.txt"))
    with pytest.raises(ConfigError, match=message) as error:
        build_datasets(_config(tmp_path, hf_tokenizer, f"[{{path: {tmp_path / 'ok.txt'}}}, {entry}]"))
    assert "\n" not in str(error.value)


def test_a_text_dataset_is_tokenized_into_the_cache_not_into_memory(tmp_path, hf_tokenizer):
    """data.dataset=text data.path=...: the corpus goes through the same cache as data.sources (read memory-mapped),
    and its windows are those of the corpus tokenized whole: the same samples as before the cache."""
    texts = lines(40)
    (tmp_path / "corpus.txt").write_text("\n".join(texts))
    config = load_config(None, [*TINY, f"train.output_dir={tmp_path / 'run'}", f"data.tokenizer={hf_tokenizer}",
                                f"data.path={tmp_path / 'corpus.txt'}", "data.eval_fraction=0.25"])
    train, evaluation, _ = build_datasets(config)
    assert isinstance(train.stream, IndexedTokens)
    assert len(list((tmp_path / "run" / "data_cache").glob("corpus-*.idx"))) == 1
    whole = ArrayTokens(tokenize_documents(["\n".join(texts)], load_tokenizer(hf_tokenizer)))
    assert train.stream.read(0, len(train.stream)).tolist() == whole.read(0, len(whole)).tolist()
    in_memory = PackedTextDataset(whole, train.window_length, train.transform, config.train.seed, stride=8,
                                  num_windows=len(train))
    for index in (0, len(train) - 1):
        assert train[index]["input_ids"].tolist() == in_memory[index]["input_ids"].tolist()
    assert evaluation is not None and len(evaluation) >= 1
    build_datasets(config)  # a second build reuses the cache
    assert len(list((tmp_path / "run" / "data_cache").glob("corpus-*.idx"))) == 1
