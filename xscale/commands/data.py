"""``xscale data tokenizer`` (train a SentencePiece model) and ``xscale data preprocess`` (text -> .bin/.idx)."""

from __future__ import annotations

import sys

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
from xscale.commands.parser import CommandParser, print_command_help
from xscale.config.check import closest
from xscale.data.corpus import stdlib_documents, text_documents
from xscale.data.load_tokenizer import load_tokenizer, tokenizer_source_file
from xscale.data.preprocess import input_bytes, tokenize_to_indexed
from xscale.data.sentencepiece_tokenizer import SentencePieceTokenizer
from xscale.data.tokenizer import DEFAULT_SENTINELS

STDLIB = "stdlib"


def _documents(source: str):
    return stdlib_documents() if source == STDLIB else text_documents(source)


def main_tokenizer(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale data tokenizer",
                                     description="Train a SentencePiece tokenizer with xscale's special tokens.")
    parser.add_argument("--input", required=True,
                        help=f"a .txt/.jsonl file, a folder of them, or '{STDLIB}' for the standard-library corpus")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--output", required=True, help="output prefix; writes PREFIX.model")
    parser.add_argument("--sentinels", type=int, default=DEFAULT_SENTINELS, help="T5 <extra_id_i> tokens")
    parser.add_argument("--model-type", choices=("unigram", "bpe"), default="unigram")
    args = parser.parse_args(argv)
    try:
        tokenizer = SentencePieceTokenizer.train(_documents(args.input), args.vocab_size,
                                                 num_sentinels=args.sentinels, model_type=args.model_type)
    except (OSError, ValueError) as error:
        print(f"xscale data tokenizer: {error}", file=sys.stderr)
        return 2
    path = tokenizer.save(args.output)
    print(f"wrote {path} ({tokenizer.vocab_size} tokens)")
    return 0


def main_preprocess(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale data preprocess",
                                     description="Tokenize text into Megatron's indexed .bin/.idx token files.")
    parser.add_argument("--input", required=True,
                        help=f"a .txt/.jsonl file, a folder of them, or '{STDLIB}' for the standard-library corpus")
    parser.add_argument("--tokenizer", required=True,
                        help="a SentencePiece .model (see xscale data tokenizer), a Hugging Face tokenizer.json (or "
                             "its folder) or a .tiktoken file")
    parser.add_argument("--output", required=True, help="output prefix; writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (the output is the same for any)")
    parser.add_argument("--text-field", default="text", help="the field of a .jsonl line that holds the text")
    parser.add_argument("--no-eos", action="store_true", help="do not end each document with eos")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.workers < 1:
        print(f"error: --workers must be at least 1, got {args.workers}", file=sys.stderr)
        return 2
    try:
        tokenizer = tokenizer_source_file(args.tokenizer)
        load_tokenizer(tokenizer)  # a bad tokenizer is refused before any worker starts
        documents = stdlib_documents() if args.input == STDLIB else text_documents(args.input, args.text_field)
        total = None if args.no_progress else (input_bytes(args.input) if args.input != STDLIB else 0) or None
        counts = tokenize_to_indexed(documents, tokenizer, args.output, workers=args.workers,
                                     append_eos=not args.no_eos, progress_total=total)
    except (OSError, ValueError, ImportError) as error:
        print(f"xscale data preprocess: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}.bin/.idx: {counts['documents']} documents, {counts['tokens']} tokens")
    return 0


TOOLS = {"tokenizer": (main_tokenizer, "train a SentencePiece tokenizer"),
         "preprocess": (main_preprocess, "tokenize text into .bin/.idx token files")}


def main(argv: list[str] | None = None) -> int:
    """``xscale data TOOL ...``: dispatch to one of :data:`TOOLS`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print_command_help("xscale data", "Data tools. xscale data TOOL --help describes each tool's options.",
                           "tools", {name: help_text for name, (_, help_text) in TOOLS.items()})
        return 0
    if not argv:
        print(f"xscale data: name a tool: {', '.join(TOOLS)} (see xscale data --help)", file=sys.stderr)
        return 2
    if argv[0] not in TOOLS:
        print(f"xscale data: unknown tool '{argv[0]}'{closest(argv[0], TOOLS)}; tools: {', '.join(TOOLS)}",
              file=sys.stderr)
        return 2
    return TOOLS[argv[0]][0](argv[1:])
