"""A SentencePiece subword model (Kudo & Richardson 2018), trained here with xscale's special tokens or loaded.

It shows the :class:`~xscale.data.tokenizer.Tokenizer` face: ``encode``/``decode``, ``vocab_size`` and the special
ids the objectives need (``pad_id``, ``bos_id``, ``eos_id``, ``unk_id``, ``mask_id``, ``sentinel_ids``).
"""

from __future__ import annotations

import functools
import io
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from xscale.data.tokenizer import DEFAULT_SENTINELS, MASK_PIECE, sentinel_piece

# SentencePiece refuses sentences longer than this many bytes; longer lines are cut for training only.
_MAX_TRAINING_LINE_BYTES = 4000


def _how_to_make(path: str | os.PathLike) -> str:
    return (f"make one with `xscale data tokenizer --input CORPUS --vocab-size N --output {Path(path).with_suffix('')}` "
            "or set data.tokenizer: null to train one on the run's corpus")


class SentencePieceTokenizer:
    """A SentencePiece model with pad=0, unk=1, bos=2, eos=3, then ``<mask>`` and ``<extra_id_i>`` sentinels.

    Models trained elsewhere load too; a special token they lack reads as ``None`` (``mask_id``) or an
    empty ``sentinel_ids``, and the objective that needs it says so.
    """

    def __init__(self, processor: spm.SentencePieceProcessor, path: str | None = None) -> None:
        self.processor = processor
        self.path = path
        self.sentinel_ids = self._sentinel_ids()

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        *,
        num_sentinels: int = DEFAULT_SENTINELS,
        model_type: str = "unigram",
        input_sentence_size: int = 200_000,
    ) -> SentencePieceTokenizer:
        """Train on texts held in memory; byte fallback and identity normalisation make decode(encode(s)) == s."""
        specials = [MASK_PIECE] + [sentinel_piece(i) for i in range(num_sentinels)]
        minimum = 4 + len(specials) + 256 + 1
        if vocab_size < minimum:
            raise ValueError(f"vocab_size={vocab_size} is too small: {len(specials) + 4} special tokens and 256 byte "
                             f"pieces need at least {minimum}; raise it or lower num_sentinels")
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_lines(texts),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            pad_id=0, unk_id=1, bos_id=2, eos_id=3,
            user_defined_symbols=specials,
            byte_fallback=True,
            character_coverage=0.9995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=False,
            hard_vocab_limit=False,
            num_threads=1,
            minloglevel=2,
        )
        processor = spm.SentencePieceProcessor()
        processor.load_from_serialized_proto(model.getvalue())
        return cls(processor)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SentencePieceTokenizer:
        """Load a ``.model`` file; a missing or unreadable file raises an error that says how to make one."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer model {path} does not exist; {_how_to_make(path)}")
        processor = spm.SentencePieceProcessor()
        content = path.read_bytes()
        try:
            processor.load_from_serialized_proto(content)
        except RuntimeError:
            kind = " (a Hugging Face tokenizer.json?)" if content.lstrip()[:1] == b"{" else ""
            raise ValueError(f"tokenizer model {path} is not a SentencePiece .model file{kind}; "
                             f"{_how_to_make(path)}") from None
        if processor.get_piece_size() == 0:
            raise ValueError(f"tokenizer model {path} is empty; {_how_to_make(path)}")
        return cls(processor, str(path))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the model atomically (concurrent ranks never see a half-written file); returns the path."""
        path = Path(path)
        if path.suffix != ".model":
            path = path.with_name(path.name + ".model")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as handle:
            handle.write(self.processor.serialized_model_proto())
        os.replace(handle.name, path)
        self.path = str(path)
        return path

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    @property
    def pad_id(self) -> int:
        return self.processor.pad_id()

    @property
    def unk_id(self) -> int:
        return self.processor.unk_id()

    @property
    def bos_id(self) -> int:
        return self.processor.bos_id()

    @property
    def eos_id(self) -> int:
        return self.processor.eos_id()

    @property
    def mask_id(self) -> int | None:
        return self._piece_id(MASK_PIECE)

    @functools.cached_property
    def special_ids(self) -> list[int]:
        """Ids that are never masked or drawn as random replacements."""
        ids = [self.pad_id, self.unk_id, self.bos_id, self.eos_id, self.mask_id, *self.sentinel_ids]
        ids += [i for i in range(self.vocab_size) if self.processor.is_control(i)]
        return sorted({i for i in ids if i is not None and i >= 0})

    def encode(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.decode([int(i) for i in ids])

    def _piece_id(self, piece: str) -> int | None:
        index = self.processor.piece_to_id(piece)
        return index if self.processor.id_to_piece(index) == piece else None

    def _sentinel_ids(self) -> list[int]:
        ids = []
        while (index := self._piece_id(sentinel_piece(len(ids)))) is not None:
            ids.append(index)
        return ids


def _training_lines(texts: Iterable[str]) -> Iterable[str]:
    for text in texts:
        for line in text.splitlines():
            encoded = line.encode("utf-8")
            while len(encoded) > _MAX_TRAINING_LINE_BYTES:
                yield encoded[:_MAX_TRAINING_LINE_BYTES].decode("utf-8", errors="ignore")
                encoded = encoded[_MAX_TRAINING_LINE_BYTES:]
            if encoded.strip():
                yield encoded.decode("utf-8", errors="ignore")
