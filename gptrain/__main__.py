"""gptrain command line.

gptrain train --config configs/debug.toml            # one process
torchrun --nproc_per_node=2 -m gptrain train ...      # one machine, two processes
gptrain prepare --input a.txt --out data/my --tokenizer byte
gptrain sample --run runs/debug --prompt "ROMEO:"
gptrain bench --config configs/bench.toml
gptrain plot --run runs/debug
gptrain export --run runs/debug --out exports/debug   # a Hugging Face GPT-2 folder
gptrain eval --run runs/debug --tasks val,hellaswag   # or --hf DIR: any GPT-2 folder
gptrain tokenizer train --input a.txt --vocab-size 4096 --out tok.json
gptrain race --config a.toml --config b.toml --seeds 5   # configs x seeds, with statistics
"""

from __future__ import annotations

import gc
import importlib
import sys
from typing import NoReturn

from gptrain.errors import UserError

# subcommand -> module whose main(argv) -> int implements it
COMMANDS = {
    "train": "gptrain.commands.train",
    "prepare": "gptrain.commands.prepare",
    "sample": "gptrain.commands.sample",
    "bench": "gptrain.commands.bench",
    "plot": "gptrain.commands.plot",
    "export": "gptrain.commands.export",
    "eval": "gptrain.commands.eval",
    "tokenizer": "gptrain.commands.tokenizer",
    "race": "gptrain.commands.race",
    "fetch": "gptrain.commands.fetch",
    "store": "gptrain.commands.store",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\ncommands: " + ", ".join(COMMANDS))
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(
            f"gptrain: error: unknown command {cmd!r}; choose one of: {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    try:
        return importlib.import_module(COMMANDS[cmd]).main(rest) or 0
    except UserError as e:
        print(f"gptrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("gptrain: interrupted", file=sys.stderr)
        return 130


def exit_quickly(code: int) -> NoReturn:
    """End the process with `code`. Objects alive now live until the process ends: frozen, the
    interpreter's exit skips the cyclic collector's passes over torch's modules (0.55 s less per
    process, measured). Also used by the worker scripts of benchmarks/ and tests/."""
    gc.freeze()
    sys.exit(code)


def entry() -> NoReturn:
    """The process's entry point (`gptrain`, `python -m gptrain`, torchrun's workers)."""
    exit_quickly(main())


if __name__ == "__main__":
    entry()
