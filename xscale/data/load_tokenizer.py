"""Pick a tokenizer kind by its path, and find the tokenizer a checkpoint carries.

``.model`` -> SentencePiece; ``.json`` or a folder holding ``tokenizer.json`` -> Hugging Face; ``.tiktoken`` ->
tiktoken. Every checkpoint holds a copy of the run's tokenizer file under ``tokenizer/`` (named by ``tokenizer`` in
its ``meta.json`` and checksummed with its other files), so ``xscale export`` and generation find it without the
training run's paths.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from xscale.data.hf_tokenizer import HFTokenizer, tokenizer_file
from xscale.data.sentencepiece_tokenizer import SentencePieceTokenizer
from xscale.data.tiktoken_tokenizer import SUFFIX as TIKTOKEN_SUFFIX
from xscale.data.tiktoken_tokenizer import TiktokenTokenizer
from xscale.data.tokenizer import Tokenizer

CHECKPOINT_FOLDER = "tokenizer"
META_KEY = "tokenizer"
KINDS = {".model": SentencePieceTokenizer, ".json": HFTokenizer, TIKTOKEN_SUFFIX: TiktokenTokenizer}


def tokenizer_kind(path: str | os.PathLike) -> type:
    """The tokenizer class for ``path``, by suffix (a folder: Hugging Face); unknown suffixes are an error."""
    path = Path(path)
    if path.is_dir():
        return HFTokenizer
    if path.suffix in KINDS:
        return KINDS[path.suffix]
    raise ValueError(f"tokenizer {path}: unknown kind; give a SentencePiece .model, a Hugging Face tokenizer.json "
                     f"(or its folder) or a tiktoken {TIKTOKEN_SUFFIX} file")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer at ``path`` (the kind picked by :func:`tokenizer_kind`)."""
    return tokenizer_kind(path).load(path)


def tokenizer_source_file(path: str | os.PathLike) -> Path:
    """The one file that holds the tokenizer ``path`` names (a folder's ``tokenizer.json``)."""
    return tokenizer_file(path) if Path(path).is_dir() else Path(path)


def checkpoint_tokenizer_name(path: str | os.PathLike) -> str:
    """Where a checkpoint keeps a copy of the tokenizer at ``path``, relative to the checkpoint directory."""
    return f"{CHECKPOINT_FOLDER}/{tokenizer_source_file(path).name}"


def tokenizer_from_checkpoint(checkpoint: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved inside a checkpoint directory (named by its ``meta.json``)."""
    checkpoint = Path(checkpoint)
    meta_file = checkpoint / "meta.json"
    try:
        name = json.loads(meta_file.read_text()).get(META_KEY)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{meta_file} cannot be read ({error}); is {checkpoint} an xscale checkpoint?") from None
    if not name:
        raise FileNotFoundError(f"checkpoint {checkpoint} holds no tokenizer (a synthetic-task run, or written "
                                "before checkpoints carried one); pass the tokenizer file explicitly")
    return load_tokenizer(checkpoint / name)
