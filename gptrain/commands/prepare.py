"""`gptrain prepare`: text (files, JSONL, Parquet, hf:, built-in corpora) or llm.c GPT-2 shards into
a prepared folder; `--export-llmc` the other way; `--verify` a folder.

gptrain prepare --input 'texts/*.txt' --out data/mine --tokenizer gpt2 --workers 8
gptrain prepare --input 'fw/*train*.bin' --val-input 'fw/*val*.bin' --out data/fw
gptrain prepare --export-llmc data/mine --out llmc/mine
gptrain prepare --verify data/mine
"""

from __future__ import annotations

import os
import shlex
import time

from gptrain.data.assemble import VAL_MAX_TOKENS
from gptrain.data.convert import export_llmc
from gptrain.data.prepare import prepare
from gptrain.data.shards import verify_dir
from gptrain.data.sources import BUILTIN_CORPORA
from gptrain.errors import ArgParser, UserError


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def add_input_options(add) -> None:
    """The inputs, the output folder, the tokenizer and the text field."""
    add(
        "--input",
        nargs="+",
        help=f"files, folders, globs, llm.c .bin shards, hf:NAME, or built-in: {', '.join(BUILTIN_CORPORA)}",
    )
    add(
        "--val-input",
        nargs="+",
        help="the validation split's own inputs (text, or llm.c val shards); default: held out from --input",
    )
    add("--out", help="folder to create (must not exist or be empty)")
    add(
        "--tokenizer",
        default=None,
        help="byte | gpt2 | bpe:PATH (default byte; gpt2 for llm.c shards)",
    )
    add("--text-field", default="text", help="JSONL key / Parquet column of the text")


def add_split_options(add) -> None:
    """The validation split, the shards, the workers and the shuffle."""
    add(
        "--val-fraction", type=float, default=0.1, help="held-out share of the tokens (default 0.1)"
    )
    add(
        "--val-max-tokens",
        type=int,
        default=VAL_MAX_TOKENS,
        help=f"cap on the held-out split with --val-fraction (default {VAL_MAX_TOKENS:,})",
    )
    add("--val-tokens", type=int, default=None, help="validation size in tokens instead")
    add("--shard-tokens", type=int, default=100_000_000)
    add(
        "--workers",
        type=int,
        default=default_workers(),
        help="tokenizing processes (default: the cores available)",
    )
    add("--seed", type=int, default=1337, help="seed of the val split (and of the shuffle)")
    add(
        "--shuffle-seed",
        type=int,
        default=None,
        help="seed of the train documents' shuffle (default --seed)",
    )
    add("--no-shuffle", action="store_true", help="keep the train documents in input order")


def arg_parser() -> ArgParser:
    """`gptrain prepare`'s options."""
    parser = ArgParser(
        prog="gptrain prepare",
        description="Tokenize text (or take llm.c shards) into shards + manifest.json.",
    )
    add = parser.add_argument
    add_input_options(add)
    add_split_options(add)
    add(
        "--utf8-errors",
        choices=["strict", "replace"],
        default="replace",
        help="replace (default): invalid UTF-8 becomes U+FFFD, counted, reported and recorded in the manifest; strict: refuse the input",
    )
    add("--no-progress", action="store_true")
    add("--verify", metavar="DIR", help="check every shard hash of a prepared folder and exit")
    add(
        "--export-llmc",
        metavar="DIR",
        help="write prepared GPT-2 folder DIR as llm.c shards into --out",
    )
    return parser


def export(args) -> int:
    """--export-llmc: a prepared GPT-2 folder written as llm.c shards into --out."""
    if not args.out:
        raise UserError("gptrain prepare --export-llmc DIR needs --out FOLDER for the llm.c shards")
    files = export_llmc(args.export_llmc, args.out)
    print(
        f"wrote {args.out}: {len(files)} llm.c shards, {sum(f['tokens'] for f in files):,} tokens"
    )
    return 0


def run_prepare(args, argv) -> int:
    """Prepare --input into --out and print what was written."""
    if not args.input or not args.out:
        raise UserError(
            "gptrain prepare: --input and --out are required (or --verify DIR, --export-llmc DIR)"
        )
    if args.no_shuffle and args.shuffle_seed is not None:
        raise UserError(
            "gptrain prepare: --no-shuffle and --shuffle-seed contradict each other; pass one"
        )
    t0 = time.perf_counter()
    m = prepare(
        args.input,
        args.out,
        args.tokenizer,
        args.val_fraction,
        args.val_tokens,
        args.shard_tokens,
        args.workers,
        args.text_field,
        args.seed,
        not args.no_progress,
        args.utf8_errors,
        command="gptrain prepare " + shlex.join(argv),
        val_inputs=args.val_input,
        val_max_tokens=args.val_max_tokens,
        shuffle=not args.no_shuffle,
        shuffle_seed=args.shuffle_seed,
    )
    s = m["splits"]
    print(
        f"wrote {args.out}: {s['train']['tokens']:,} train + {s['val']['tokens']:,} val tokens, "
        f"{len(m['shards'])} shards, tokenizer {m['tokenizer']['name']}, {time.perf_counter() - t0:.1f}s"
    )
    return 0


def main(argv) -> int:
    args = arg_parser().parse_args(argv)
    if args.verify:
        verify_dir(args.verify)
        print(f"ok: {args.verify}: every shard matches its manifest hash")
        return 0
    if args.export_llmc:
        return export(args)
    return run_prepare(args, argv)
