"""`qkv prepare INPUT... --out DATA_DIR`: tokenize a corpus once into shards that `qkv train --data` streams.

    qkv prepare books/ --out data/books                         # GPT-2's tokenizer, 1 % of documents held out
    qkv prepare 'crawl/*.jsonl.gz' --out data/crawl --val-tokens 1000000
    qkv prepare notes.txt --out data/notes --tokenizer bpe --vocab-size 4096
    qkv prepare corpus.parquet --column content --out data/ft --tokenizer runs/my-run   # a run's tokenizer
    qkv prepare --verify data/books                             # headers, sizes, sha256 and token ranges

INPUT: UTF-8 text files (.gz too), JSON Lines (.jsonl, .ndjson, .jsonl.gz: one document per row, its
--text-field), Parquet (.parquet: one document per row, its --column), directories (every file in them,
sorted) and globs. Killed, the same command goes on from the last finished shard.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from qkv.data.options import SHARD_TOKENS, Split, TokenizerRecipe
from qkv.errors import QkvError

TOKENIZER_NAMES = ("char", "bpe", "gpt2")
BPE = TokenizerRecipe("bpe")  # its defaults, for the help


def register(sub: Any) -> None:
    """Add the `prepare` sub-command to the `qkv` parser."""
    p = sub.add_parser("prepare", help="tokenize a corpus once into shards that `qkv train --data` streams",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.set_defaults(handler=cmd_prepare)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, directories or globs (with --verify: DATA_DIR)")
    p.add_argument("--out", metavar="DATA_DIR", help="the directory to write (new, or one this command started)")
    p.add_argument("--verify", action="store_true", help="check a prepared DATA_DIR: headers, sizes, hashes, ids")
    p.add_argument("--tokenizer", default="gpt2",
                   help="gpt2 (default), char, bpe (learnt from the corpus), or the path of a qkv run, a `qkv "
                        "convert` directory, a Hugging Face directory or a .gguf whose tokenizer to use")  # fmt: skip
    p.add_argument("--vocab-size", type=int, help=f"bpe: the vocabulary's size (default {BPE.vocab_size:,})")
    p.add_argument("--sample-bytes", type=int,
                   help=f"bpe: bytes of training text it learns from (default {BPE.sample_bytes:,})")  # fmt: skip
    p.add_argument("--special-tokens", help="bpe: comma-separated special tokens, first ids (default <|endoftext|>; "
                                            "a masked LM needs <|endoftext|>,<mask>)")  # fmt: skip
    p.add_argument("--text-field", default="text", help="JSON Lines: the field holding a document (default text)")
    p.add_argument("--column", default="text", help="Parquet: the column holding a document (default text)")
    p.add_argument("--separator", help=r"text files: the string between documents, e.g. '\n\n\n' (default: a "
                                       "file is one document)")  # fmt: skip
    split = p.add_mutually_exclusive_group()
    split.add_argument("--val-fraction", type=float,
                       help=f"share of documents held out: every k-th one for 1/k, the first included (default "
                            f"{Split().val_fraction})")  # fmt: skip
    split.add_argument("--val-tokens", type=int, help="hold out the first documents, until this many tokens")
    p.add_argument("--shard-tokens", type=int, help=f"tokens per shard (default {SHARD_TOKENS:,}, as llm.c)")
    p.add_argument("--workers", type=int, help="tokenizing processes (default: one per core; 0: none)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="bytes that are not UTF-8: strict stops at the first (naming its offset), replace turns each "
                        "into U+FFFD")  # fmt: skip


def cmd_prepare(args: argparse.Namespace) -> int:
    """Prepare (or verify) a data directory."""
    if args.verify:
        from qkv.data.tokens import verify_data

        if len(args.inputs) != 1 or args.out is not None:
            raise QkvError("--verify takes one DATA_DIR and no --out")
        print(verify_data(Path(args.inputs[0])))
        return 0
    if not args.out:
        raise QkvError("give --out DATA_DIR: the directory to write the shards to")
    from qkv.data.options import PrepareOptions
    from qkv.data.prepare import check_output, prepare
    from qkv.data.sources import ReadOptions

    check_output(args.inputs, args.out)  # before the tokenizer: its own errors would hide this one
    tokenizer = _tokenizer(args)
    # '\n\n' typed in a shell is a backslash and an n: read escapes, keep every other character as it is.
    separator = None if args.separator is None else args.separator.encode("raw_unicode_escape").decode(
        "unicode_escape")  # fmt: skip
    read = ReadOptions(args.text_field, args.column, separator, args.errors)
    split = Split(val_tokens=args.val_tokens) if args.val_tokens is not None else Split(
        **({} if args.val_fraction is None else {"val_fraction": args.val_fraction}))  # fmt: skip
    options = PrepareOptions(read, split, **_given(args, shard_tokens="shard_tokens", workers="workers"))
    prepare(args.inputs, args.out, tokenizer, _name(args.tokenizer), options)
    return 0


def _given(args: argparse.Namespace, **names: str) -> dict[str, Any]:
    """The options that were given, by their keyword."""
    return {key: getattr(args, name) for key, name in names.items() if getattr(args, name) is not None}


def _name(spec: str) -> str:
    """How meta.json names a tokenizer: its kind, or the checkpoint's absolute path."""
    return spec if spec in TOKENIZER_NAMES else str(Path(spec).expanduser().resolve())


def _tokenizer(args: argparse.Namespace) -> Any:
    """GPT-2's, a recipe (char, bpe), or a checkpoint's tokenizer; BPE options are refused for the others."""
    bpe_options = _given(args, vocab_size="vocab_size", sample_bytes="sample_bytes", special_tokens="special_tokens")
    if args.tokenizer != "bpe" and bpe_options:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in bpe_options)
        raise QkvError(f"{flags}: options of a BPE learnt from the corpus (--tokenizer bpe), not of {args.tokenizer}")
    if args.tokenizer == "gpt2":
        from qkv.tokenizers.gpt2 import gpt2_tokenizer

        return gpt2_tokenizer()
    if args.tokenizer == "char":
        return TokenizerRecipe("char")
    if args.tokenizer == "bpe":
        if "special_tokens" in bpe_options:
            bpe_options["special_tokens"] = tuple(t for t in bpe_options["special_tokens"].split(",") if t)
        return TokenizerRecipe("bpe", **bpe_options)
    if not Path(args.tokenizer).exists():
        raise QkvError(f"--tokenizer {args.tokenizer}: not char, bpe or gpt2, and no such file or directory")
    from qkv.interop import tokenizer_of

    return tokenizer_of(args.tokenizer)
