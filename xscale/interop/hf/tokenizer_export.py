"""The files beside an exported model that Hugging Face tools read as they are: the special ids in ``config.json``,
``generation_config.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

``AutoTokenizer.from_pretrained(export)`` then encodes a text to the ids xscale's tokenizer gives: a
``tokenizer.json`` (any of its models: BPE as GPT-2's byte-level one, Unigram, WordPiece) loads as
``PreTrainedTokenizerFast``; a SentencePiece ``tokenizer.model`` as transformers' ``SentencePieceBackend`` with
``legacy`` on (the model's own encoding, transformers 5), since ``LlamaTokenizer`` re-derives the pieces and
splits differently. Neither adds a bos or eos token, as xscale's encoding does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xscale.data.hf_tokenizer import HFTokenizer
from xscale.data.load_tokenizer import load_tokenizer
from xscale.data.sentencepiece_tokenizer import SentencePieceTokenizer
from xscale.data.tokenizer import Tokenizer

SPECIAL_ROLES = ("bos", "eos", "pad", "unk", "mask")
TOKENIZER_CLASSES = {"tokenizer.json": "PreTrainedTokenizerFast", "tokenizer.model": "SentencePieceBackend"}


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """``bos_token_id``, ``eos_token_id``, ``pad_token_id`` (those the tokenizer has), as ``config.json`` names them."""
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    return {name: int(index) for name, index in ids.items() if index is not None and index >= 0}


def _piece(tokenizer: Tokenizer, index: int | None) -> str | None:
    """The text of token ``index`` in the vocabulary (a special token decodes to nothing, so it is looked up)."""
    if index is None or index < 0:
        return None
    if isinstance(tokenizer, SentencePieceTokenizer):
        return tokenizer.processor.id_to_piece(index)
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.backend.id_to_token(index)
    return None


def special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """``bos_token`` ... ``mask_token``: the piece of each special id the tokenizer has."""
    pieces = {f"{role}_token": _piece(tokenizer, getattr(tokenizer, f"{role}_id")) for role in SPECIAL_ROLES}
    return {name: piece for name, piece in pieces.items() if piece}


def write_tokenizer_files(output: Path, copied: list[str], max_length: int) -> dict[str, int]:
    """Write ``tokenizer_config.json`` and ``special_tokens_map.json`` for the tokenizer file in ``copied`` (kept
    when the source folder carried its own) and return its special ids for ``config.json`` ({} without one)."""
    main = next((name for name in TOKENIZER_CLASSES if name in copied), None)
    if main is None:
        return {}
    tokenizer = load_tokenizer(output / main)
    tokens = special_tokens(tokenizer)
    if "tokenizer_config.json" not in copied:
        config: dict[str, Any] = {"tokenizer_class": TOKENIZER_CLASSES[main], **tokens, "add_bos_token": False,
                                  "add_eos_token": False, "clean_up_tokenization_spaces": False,
                                  "model_max_length": max_length}
        if main == "tokenizer.model":
            config.update(legacy=True, backend="sentencepiece")
        (output / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if "special_tokens_map.json" not in copied:
        (output / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2, sort_keys=True) + "\n")
    return special_ids(tokenizer)


def write_generation_config(output: Path, ids: dict[str, int]) -> None:
    """``generation_config.json``: the special ids ``generate`` stops at and pads with (greedy by default)."""
    (output / "generation_config.json").write_text(json.dumps({**ids, "_from_model_config": True}, indent=2,
                                                              sort_keys=True) + "\n")
