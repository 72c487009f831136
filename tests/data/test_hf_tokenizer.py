"""A Hugging Face tokenizer.json trained here with the tokenizers library: round trips and special ids."""

from __future__ import annotations

import json

import pytest

from tests.data.conftest import lines
from xscale.data.hf_tokenizer import HFTokenizer
from xscale.data.load_tokenizer import load_tokenizer
from xscale.data.tokenizer import Tokenizer


def test_tokenizer_json_round_trips_and_names_its_special_ids(hf_tokenizer):
    tokenizer = load_tokenizer(hf_tokenizer)
    assert isinstance(tokenizer, HFTokenizer) and isinstance(tokenizer, Tokenizer)
    for text in lines(5) + ["theta iota kappa", "alphabet"]:
        ids = tokenizer.encode(text)
        assert ids and tokenizer.decode(ids) == text
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.mask_id) == (0, 1, 2, 3, 4)
    assert tokenizer.special_ids == [0, 1, 2, 3, 4] and tokenizer.vocab_size < 100
    assert tokenizer.encode("alpha beta") == tokenizer.encode("alpha beta")  # no bos/eos added by encode


def test_a_folder_and_its_tokenizer_config_pick_the_special_tokens(hf_tokenizer, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(hf_tokenizer.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>", "pad_token": {"content": "<unk>"}}))
    tokenizer = load_tokenizer(tmp_path)
    assert (tokenizer.eos_id, tokenizer.pad_id, tokenizer.path) == (2, 1, str(tmp_path / "tokenizer.json"))


def test_a_vocabulary_without_an_end_of_document_token_is_refused(hf_tokenizer, tmp_path):
    data = json.loads(hf_tokenizer.read_text())
    data["added_tokens"] = [token for token in data["added_tokens"] if token["content"] != "</s>"]
    data["model"]["vocab"].pop("</s>")
    (tmp_path / "no_eos.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no end-of-document token"):
        load_tokenizer(tmp_path / "no_eos.json")
