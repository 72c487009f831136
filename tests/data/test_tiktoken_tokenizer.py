"""A tiktoken encoding from a local .tiktoken file written here (256 byte tokens plus a few merges): no download."""

from __future__ import annotations

import base64

import pytest

from xscale.data.load_tokenizer import load_tokenizer
from xscale.data.tiktoken_tokenizer import TiktokenTokenizer

MERGES = [b"al", b"ph", b"pha", b"alpha", b" b", b"et", b" bet", b" beta"]


@pytest.fixture
def tiktoken_file(tmp_path):
    pytest.importorskip("tiktoken")
    tokens = [bytes([byte]) for byte in range(256)] + MERGES
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens)))
    return path


def test_a_local_tiktoken_file_round_trips_with_eos_after_its_ranks(tiktoken_file):
    tokenizer = load_tokenizer(tiktoken_file)
    assert isinstance(tokenizer, TiktokenTokenizer)
    assert tokenizer.encode("alpha beta") == [256 + MERGES.index(b"alpha"), 256 + MERGES.index(b" beta")]
    for text in ("alpha beta gamma", "ünïcode ✓", "<|endoftext|> is text here"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_id == tokenizer.pad_id == 256 + len(MERGES)
    assert tokenizer.vocab_size == 256 + len(MERGES) + 1 and tokenizer.special_ids == [tokenizer.eos_id]
    assert tokenizer.eos_id not in tokenizer.encode("<|endoftext|>")


def test_a_malformed_tiktoken_file_names_its_line(tmp_path):
    pytest.importorskip("tiktoken")
    (tmp_path / "bad.tiktoken").write_text("YQ== 0\nnot base64!! 1\n")
    with pytest.raises(ValueError, match=r"bad.tiktoken:2 is not 'base64-token rank'"):
        load_tokenizer(tmp_path / "bad.tiktoken")
