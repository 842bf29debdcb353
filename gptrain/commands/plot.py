"""`gptrain plot`: loss.png of a run from its metrics.jsonl.

gptrain plot --run runs/default
"""

from __future__ import annotations

from gptrain.errors import ArgParser
from gptrain.logs.plot import plot_run


def main(argv: list[str]) -> int:
    parser = ArgParser(prog="gptrain plot", description="plot a run's loss curves")
    parser.add_argument("--run", required=True, help="run directory (run.dir of gptrain train)")
    parser.add_argument("--out", default=None, help="output PNG (default RUN/loss.png)")
    args = parser.parse_args(argv)
    print(plot_run(args.run, args.out))
    return 0
