"""`gptrain prepare`: text (files, JSONL, Parquet, hf:, built-in corpora) into token shards.

gptrain prepare --input 'texts/*.txt' --out data/mine --tokenizer gpt2 --workers 8
gptrain prepare --verify data/mine
"""

from __future__ import annotations

import os
import shlex
import time

from gptrain.data.prepare import prepare
from gptrain.data.shards import verify_dir
from gptrain.data.sources import BUILTIN_CORPORA
from gptrain.errors import ArgParser, UserError


def main(argv) -> int:
    parser = ArgParser(
        prog="gptrain prepare", description="Tokenize text into shards + manifest.json."
    )
    parser.add_argument(
        "--input",
        nargs="+",
        help=f"files, folders, globs, hf:NAME, or built-in: {', '.join(BUILTIN_CORPORA)}",
    )
    parser.add_argument("--out", help="folder to create (must not exist or be empty)")
    parser.add_argument("--tokenizer", default="byte", help="byte | gpt2 | bpe:PATH (default byte)")
    parser.add_argument(
        "--text-field", default="text", help="JSONL key / Parquet column of the text"
    )
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument(
        "--val-tokens", type=int, default=None, help="validation size in tokens instead"
    )
    parser.add_argument("--shard-tokens", type=int, default=100_000_000)
    parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8))
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument(
        "--utf8-errors",
        choices=["strict", "replace"],
        default="replace",
        help="replace (default): invalid UTF-8 becomes U+FFFD, counted, reported and recorded in the manifest; strict: refuse the input",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--verify", metavar="DIR", help="check every shard hash of a prepared folder and exit"
    )
    args = parser.parse_args(argv)
    if args.verify:
        verify_dir(args.verify)
        print(f"ok: {args.verify}: every shard matches its manifest hash")
        return 0
    if not args.input or not args.out:
        raise UserError("gptrain prepare: --input and --out are required (or --verify DIR)")
    t0 = time.perf_counter()
    m = prepare(
        args.input, args.out, args.tokenizer, args.val_fraction, args.val_tokens, args.shard_tokens,
        args.workers, args.text_field, args.seed, not args.no_progress, args.utf8_errors,
        command="gptrain prepare " + shlex.join(argv),
    )  # fmt: skip
    s = m["splits"]
    print(f"wrote {args.out}: {s['train']['tokens']:,} train + {s['val']['tokens']:,} val tokens, "
          f"{len(m['shards'])} shards, tokenizer {m['tokenizer']['name']}, {time.perf_counter() - t0:.1f}s")  # fmt: skip
    return 0
