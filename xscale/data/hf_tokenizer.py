"""A Hugging Face ``tokenizer.json`` (the ``tokenizers`` library's serialisation), or a folder holding one.

Special ids are found by the names models use for them (``</s>``, ``<|endoftext|>``, ``[SEP]`` ...); a folder's
``tokenizer_config.json`` (``eos_token``, ``pad_token``, ...) takes precedence. A vocabulary without a pad token
pads with eos (the loss never reads padding).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from xscale.data.tokenizer import MASK_PIECE, sentinel_piece

try:
    import tokenizers
except ImportError:  # the optional extra: xscale[hf]
    tokenizers = None

FILE_NAME = "tokenizer.json"
# Names the common vocabularies give each special token, in order of preference.
_NAMES = {
    "eos": ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[SEP]"),
    "pad": ("<pad>", "[PAD]", "<|padding|>", "<|pad|>"),
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]"),
    "unk": ("<unk>", "[UNK]", "<|unk|>"),
    "mask": (MASK_PIECE, "[MASK]"),
}


def tokenizer_file(path: str | os.PathLike) -> Path:
    """The ``tokenizer.json`` that ``path`` names: the file itself, or the one inside a folder."""
    path = Path(path)
    return path / FILE_NAME if path.is_dir() else path


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind xscale's :class:`~xscale.data.tokenizer.Tokenizer` face."""

    def __init__(self, backend, path: str | None = None, special_names: dict[str, str] | None = None) -> None:
        self.backend = backend
        self.path = path
        vocab = backend.get_vocab(with_added_tokens=True)
        names = special_names or {}
        self._ids = {role: _first_present(vocab, ((names[role],) if role in names else ()) + candidates)
                     for role, candidates in _NAMES.items()}
        if self._ids["eos"] is None:
            raise ValueError(f"tokenizer {path}: no end-of-document token ({', '.join(_NAMES['eos'])}); add one "
                             "(documents are separated by it when packed)")
        self.sentinel_ids = []
        while (index := vocab.get(sentinel_piece(len(self.sentinel_ids)))) is not None:
            self.sentinel_ids.append(index)
        self._special = sorted({token.content for token in backend.get_added_tokens_decoder().values()
                                if token.special})
        self._vocab = vocab

    @classmethod
    def load(cls, path: str | os.PathLike) -> HFTokenizer:
        """Load ``tokenizer.json`` (or a folder holding it and, optionally, ``tokenizer_config.json``)."""
        if tokenizers is None:
            raise ImportError("Hugging Face tokenizer.json files need the tokenizers package: "
                              "pip install 'xscale[hf]' (or pip install tokenizers)")
        file = tokenizer_file(path)
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer {file} does not exist; point data.tokenizer at a tokenizer.json or "
                                    "the folder holding one")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as error:  # the Rust library raises its own exception type
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"tokenizer {file} is not a Hugging Face tokenizer.json ({reason})") from None
        return cls(backend, str(file), _configured_specials(file.parent / "tokenizer_config.json"))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._ids["eos"]

    @property
    def pad_id(self) -> int:
        return self._ids["pad"] if self._ids["pad"] is not None else self._ids["eos"]

    @property
    def bos_id(self) -> int | None:
        return self._ids["bos"]

    @property
    def unk_id(self) -> int | None:
        return self._ids["unk"]

    @property
    def mask_id(self) -> int | None:
        return self._ids["mask"]

    @property
    def special_ids(self) -> list[int]:
        ids = [self._vocab[name] for name in self._special] + self.sentinel_ids
        ids += [index for index in self._ids.values() if index is not None]
        return sorted(set(ids))

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)


def _first_present(vocab: dict[str, int], names: Sequence[str]) -> int | None:
    return next((vocab[name] for name in names if name in vocab), None)


def _configured_specials(config_file: Path) -> dict[str, str]:
    """``{"eos": "</s>", ...}`` from a transformers ``tokenizer_config.json`` beside the tokenizer, if any."""
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file} is not JSON ({error}); fix or remove it") from None
    names = {}
    for role in _NAMES:
        value = config.get(f"{role}_token") if isinstance(config, dict) else None
        if isinstance(value, dict):  # transformers' serialised AddedToken
            value = value.get("content")
        if isinstance(value, str):
            names[role] = value
    return names
