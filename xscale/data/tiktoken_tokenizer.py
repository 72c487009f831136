"""A tiktoken byte-level BPE encoding read from a local ``.tiktoken`` file (one ``base64(token) rank`` per line).

tiktoken's named encodings download their rank files; here the file is given (``data.tokenizer:
path/cl100k_base.tiktoken``), read directly (never through tiktoken's download cache) and nothing is fetched. A
file named after a published encoding gets that encoding's split pattern and special tokens; any other file the
GPT-2 pattern and ``<|endoftext|>`` right after its ranks. Padding uses eos (the loss never reads padding).
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Sequence
from pathlib import Path

try:
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str as GPT2_PATTERN
except ImportError:  # the optional extra: xscale[tiktoken]
    tiktoken = None
    GPT2_PATTERN = None

SUFFIX = ".tiktoken"
ENDOFTEXT = "<|endoftext|>"
_CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]?+[\r\n]*+"""
                   r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
# Published encodings: (split pattern, special tokens); None means the GPT-2 pattern.
_PUBLISHED = {
    "gpt2": (None, {ENDOFTEXT: 50256}),
    "r50k_base": (None, {ENDOFTEXT: 50256}),
    "p50k_base": (None, {ENDOFTEXT: 50256}),
    "cl100k_base": (_CL100K_PATTERN, {ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                                      "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}),
}


def read_ranks(path: Path) -> dict[bytes, int]:
    """The mergeable ranks of a ``.tiktoken`` file; a malformed line is an error naming it."""
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"{path}:{number} is not 'base64-token rank'; is this a .tiktoken file?") from None
    if not ranks:
        raise ValueError(f"{path} holds no tokens")
    return ranks


class TiktokenTokenizer:
    """A ``tiktoken.Encoding`` behind xscale's :class:`~xscale.data.tokenizer.Tokenizer` face."""

    def __init__(self, encoding, path: str | None = None) -> None:
        self.encoding = encoding
        self.path = path
        self.sentinel_ids: list[int] = []

    @classmethod
    def load(cls, path: str | os.PathLike) -> TiktokenTokenizer:
        if tiktoken is None:
            raise ImportError("tiktoken encodings need the tiktoken package: pip install 'xscale[tiktoken]' "
                              "(or pip install tiktoken)")
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tiktoken file {path} does not exist; point data.tokenizer at a local "
                                    f"{SUFFIX} file (e.g. cl100k_base{SUFFIX})")
        ranks = read_ranks(path)
        pattern, specials = _PUBLISHED.get(path.stem, (None, {ENDOFTEXT: max(ranks.values()) + 1}))
        encoding = tiktoken.Encoding(name=path.stem, pat_str=pattern or GPT2_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=specials)
        return cls(encoding, str(path))

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def eos_id(self) -> int:
        return self.encoding.eot_token

    @property
    def pad_id(self) -> int:
        return self.eos_id

    @property
    def bos_id(self) -> int | None:
        return None

    @property
    def unk_id(self) -> int | None:
        return None  # byte-level: every text encodes

    @property
    def mask_id(self) -> int | None:
        return None

    @property
    def special_ids(self) -> list[int]:
        return sorted(self.encoding.encode_single_token(token) for token in self.encoding.special_tokens_set)

    def encode(self, text: str) -> list[int]:
        """Special-token text in the input is encoded as ordinary text, never as the special token."""
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])
