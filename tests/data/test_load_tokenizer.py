"""The tokenizer kind follows the path, and every checkpoint carries (and checksums) the run's tokenizer."""

from __future__ import annotations

import json

import pytest

from tests.data.conftest import lines
from xscale.checkpoint.checkpointer import Checkpointer, CheckpointError
from xscale.config.load import load_config
from xscale.data.hf_tokenizer import HFTokenizer
from xscale.data.load_tokenizer import load_tokenizer, tokenizer_from_checkpoint, tokenizer_kind
from xscale.data.sentencepiece_tokenizer import SentencePieceTokenizer
from xscale.data.tiktoken_tokenizer import TiktokenTokenizer
from xscale.train.trainer import Trainer

TINY = ["model.vocab_size=96", "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "train.global_batch_size=4",
        "train.seq_len=8", "train.steps=2", "train.tensorboard=false", "train.plot=false", "train.progress=false",
        "train.peak_flops=1e12", "data.dataset=text"]


def test_the_kind_follows_the_suffix(tmp_path, hf_tokenizer):
    assert tokenizer_kind("a/b.model") is SentencePieceTokenizer
    assert tokenizer_kind("a/tokenizer.json") is HFTokenizer and tokenizer_kind(hf_tokenizer.parent) is HFTokenizer
    assert tokenizer_kind("a/cl100k_base.tiktoken") is TiktokenTokenizer
    with pytest.raises(ValueError, match=r"vocab.txt: unknown kind; give a SentencePiece \.model"):
        load_tokenizer(tmp_path / "vocab.txt")


def test_a_checkpoint_carries_the_tokenizer(tmp_path, hf_tokenizer):
    (tmp_path / "web.txt").write_text("\n".join(lines(40)))
    own = tmp_path / "tokenizer.json"
    own.write_bytes(hf_tokenizer.read_bytes())
    config = load_config(None, [*TINY, f"train.output_dir={tmp_path / 'run'}", f"data.tokenizer={own}",
                                f"data.sources=[{{path: {tmp_path / 'web.txt'}}}]"])
    Trainer(config).fit()
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["tokenizer"] == "tokenizer/tokenizer.json" and "tokenizer/tokenizer.json" in meta["sha256"]
    own.unlink()  # the run's own file is gone: the checkpoint's copy serves
    tokenizer = tokenizer_from_checkpoint(checkpoint)
    assert tokenizer.decode(tokenizer.encode(lines(1)[0])) == lines(1)[0]
    (checkpoint / "tokenizer" / "tokenizer.json").write_text("{}")  # a changed copy fails the checksum
    with pytest.raises(CheckpointError, match="tokenizer/tokenizer.json"):
        Checkpointer.read_meta(checkpoint, verify="full")


def test_a_synthetic_task_checkpoint_says_it_has_no_tokenizer(tmp_path):
    config = load_config(None, [*TINY[:-1], f"train.output_dir={tmp_path}", "data.dataset=copy",
                                "data.num_samples=32", "data.eval_fraction=0"])
    Trainer(config).fit()
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        tokenizer_from_checkpoint(tmp_path / "checkpoints" / "step_00000002")
