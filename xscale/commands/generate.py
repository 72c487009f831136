"""``xscale generate CHECKPOINT --prompt TEXT``: continue a prompt with a trained decoder and print the text.

Decoding: decoders whose attention is dense (dense / mha / gqa / mqa, any position encoding) keep a KV cache and feed
one token per step; every other attention kind (sparse patterns, linear, low-rank, content-based, RealFormer, ...)
recomputes the whole prefix at each step (the same tokens, slower). Sampling: greedy with --temperature 0, else
softmax(logits / temperature) restricted by --top-k then --top-p, drawn from a generator seeded by --seed.
Stops at the tokenizer's eos or after --max-new-tokens. MoE layers route each forward's tokens as one group: with a
capacity cut (not dropless), recomputing may drop a token that the cache's one-token steps keep.
"""

from __future__ import annotations

import argparse
import sys

import torch

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
from xscale.checkpoint.checkpointer import CheckpointError
from xscale.commands.parser import CommandParser
from xscale.commands.trained import TrainedModel, load_tokenizer, load_trained_model
from xscale.config.schema import ConfigError
from xscale.data.fixed_vocab import FixedVocab
from xscale.data.tokenizer import Tokenizer
from xscale.generation import Sampling, generate
from xscale.generation.decode import check_decoder


def _parser() -> CommandParser:
    parser = CommandParser(prog="xscale generate", description=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a run directory, a checkpoint root (its latest) or a step directory")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text to continue (encoded with the run's tokenizer)")
    prompt.add_argument("--tokens", help="token ids to continue, comma-separated (e.g. 2,17,5); prints ids")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus: smallest set reaching probability p")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    parser.add_argument("--tokenizer", help="a SentencePiece .model, a Hugging Face tokenizer.json (or its folder) or a "
                        "tiktoken .tiktoken file (default: the one the run used)")
    parser.add_argument("--no-cache", action="store_true", help="recompute the prefix at every step")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    return parser


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--tokens {text!r}: give comma-separated integer ids, e.g. --tokens 2,17,5") from None
    if not ids or min(ids) < 0:
        raise ValueError(f"--tokens {text!r}: give at least one non-negative id, e.g. --tokens 2,17,5")
    return ids


def _quietly(trained: TrainedModel) -> Tokenizer | FixedVocab | None:
    """The run's tokenizer for its eos id when --tokens gives ids, or None when it cannot be found."""
    try:
        return load_tokenizer(trained)
    except ConfigError:
        return None


def run(args: argparse.Namespace) -> str:
    """The generated continuation: text for --prompt, comma-separated ids for --tokens."""
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    ids = _token_ids(args.tokens) if args.tokens is not None else None
    trained = load_trained_model(args.checkpoint, device=args.device)
    tokenizer = load_tokenizer(trained, args.tokenizer) if ids is None or args.tokenizer else _quietly(trained)
    if ids is None:
        ids = tokenizer.encode(args.prompt)
    vocab = trained.config.model.vocab_size
    if max(ids, default=0) >= vocab:
        raise ValueError(f"token id {max(ids)} is outside the model's vocabulary of {vocab} (model.vocab_size); "
                         "use the tokenizer the run was trained with")
    check_decoder(trained.model, len(ids), args.max_new_tokens)
    prompt = torch.tensor([ids], dtype=torch.long, device=args.device)
    eos_id = tokenizer.eos_id if tokenizer is not None else None
    result = generate(trained.model, prompt, args.max_new_tokens, sampling, seed=args.seed, eos_id=eos_id,
                      use_cache=False if args.no_cache else None,
                      vocab_size=tokenizer.vocab_size if tokenizer is not None else None)
    new = result.tokens[0].tolist()
    if eos_id is not None and eos_id in new:
        new = new[:new.index(eos_id)]
    return ",".join(str(token) for token in new) if args.tokens is not None else tokenizer.decode(new)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        text = run(args)
    except (CheckpointError, ConfigError, ValueError) as error:
        print(f"xscale generate: {' '.join(line.strip() for line in str(error).splitlines())}", file=sys.stderr)
        return 2
    print(text)
    return 0
