"""A checkpoint of a tiny ``xscale train`` run on a small text corpus (its tokenizer trained and cached by the
trainer), shared by the tests of the commands that read checkpoints (eval, generate)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from xscale.cli import main

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
TINY_RUN = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
            "model.max_seq_len=64", "train.steps=3", "train.global_batch_size=2", "train.seq_len=16",
            "train.tensorboard=false", "train.plot=false", "train.progress=false", "train.peak_flops=1e12",
            "train.watchdog=false", "data.dataset=text", "data.tokenizer_vocab_size=400", "data.eval_fraction=0.2"]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """The output directory of a 3-step run (checkpoints/latest, tokenizer/text-400.model)."""
    root = tmp_path_factory.mktemp("trained_run")
    rng = random.Random(0)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(300)))
    run = root / "run"
    assert main(["train", *TINY_RUN, f"data.path={corpus}", f"train.output_dir={run}"]) == 0
    assert (run / "checkpoints" / "latest").is_file() and (run / "tokenizer" / "text-400.model").is_file()
    return run
