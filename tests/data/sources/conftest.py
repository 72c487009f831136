"""A small text corpus, its tokens as an indexed file, and one tiny config per registered dataset."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.conftest import lines
from xscale.config.load import load_config
from xscale.config.schema import Config
from xscale.data.preprocess import tokenize_to_indexed

TINY = ["model.vocab_size=96", "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "train.global_batch_size=4",
        "train.seq_len=8", "data.num_samples=16", "data.eval_fraction=0.25"]
CLASSIFY = ["model.family=encoder", "train.task=classify"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, hf_tokenizer) -> dict[str, Path]:
    """``text``: a .txt file; ``indexed``: its tokens' .bin/.idx prefix; ``labeled``: a .tsv of two labels."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "docs.txt").write_text("\n\n".join(lines(40)))
    counts = tokenize_to_indexed(iter(lines(40)), str(hf_tokenizer), str(root / "docs"))
    assert counts["tokens"] > 0
    (root / "labels.tsv").write_text("".join(f"{i % 2}\t{text}\n" for i, text in enumerate(lines(20))))
    return {"text": root / "docs.txt", "indexed": root / "docs", "labeled": root / "labels.tsv"}


def overrides(name: str, corpus: dict[str, Path], hf_tokenizer: Path) -> list[str]:
    """The config overrides of a small build of the dataset ``name``."""
    tokenizer = [f"data.tokenizer={hf_tokenizer}"]
    return {
        "stdlib_text": tokenizer,
        "text": [*tokenizer, f"data.path={corpus['text']}"],
        "indexed": [*tokenizer, f"data.path={corpus['indexed']}"],
        "copy": ["train.seq_len=16", "model.vocab_size=64"],
        "assoc_recall": ["train.seq_len=16", "data.dataset.options={num_keys: 8, num_values: 8}"],
        "listops": ["train.seq_len=32"],
        "labeled": [*CLASSIFY, *tokenizer, f"data.path={corpus['labeled']}"],
        "lra_listops": [*CLASSIFY, "train.seq_len=65", "data.dataset.options={max_depth: 3}"],
        "lra_retrieval": [*CLASSIFY, "train.seq_len=65", "model.vocab_size=288"],
        "lra_pathfinder": [*CLASSIFY, "train.seq_len=65"],
        "images_shapes": [*CLASSIFY, "model.input=patches", "train.seq_len=17", "model.position=learned"],
    }[name]


@pytest.fixture
def build_config(tmp_path, corpus, hf_tokenizer):
    """``build_config(name, *extra)``: a small config of the dataset ``name``, writing under tmp_path."""
    def build(name: str, *extra: str) -> Config:
        return load_config(None, [*TINY, f"train.output_dir={tmp_path / 'run'}", f"data.dataset={name}",
                                  *overrides(name, corpus, hf_tokenizer), *extra])
    return build
