"""Small corpora and a Hugging Face BPE tokenizer trained here (nothing downloaded), shared by the data tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<mask>"]


def lines(count: int, shift: int = 0) -> list[str]:
    """``count`` lines of ten words; ``shift`` changes the word order (another corpus, same vocabulary)."""
    return [" ".join(WORDS[(i * 7 + j * (shift + 1)) % len(WORDS)] for j in range(10)) for i in range(count)]


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory) -> Path:
    """A tokenizer.json: BPE with a Metaspace pre-tokenizer (exact round trips), under 100 tokens."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(lines(50) + lines(50, shift=2), trainers.BpeTrainer(vocab_size=80,
                                                                                      special_tokens=SPECIALS))
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: text, "id": i}) + "\n" for i, text in enumerate(texts)))
    return path
