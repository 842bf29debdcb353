"""The output head's loss, chunked against full logits (`train.loss`), at GPT-2 124M's head.

    PYTHONPATH=. python benchmarks/cpu/bench_loss.py                         # CPU, eager
    PYTHONPATH=. python benchmarks/cpu/bench_loss.py --compile               # also torch.compile'd
    PYTHONPATH=. python benchmarks/cpu/bench_loss.py --device cuda --rows 8192,65536 --rounds 9

Forward + backward of the head's loss (width 768 against the 50257-token vocabulary, padded to
50304) on ROWS rows of hidden states, in each dtype's autocast: the workload `train.loss = auto`
times at start-up (`gptrain/training/timing.py`, `loss_run`), by each path: chunked
(`linear_cross_entropy`, 667-row chunks, or at most 8 chunks compiled) and full (the full logits,
then F.cross_entropy; compiled, fused by inductor). Rounds alternate the order of the candidates;
medians over the rounds, the ratio per round (both paths under the same load), then its median.
The memory column is what each path holds beyond its inputs, computed: full, the logits, their
float32 log-probabilities and gradient (choices.FULL_LOGITS_BYTES per element); chunked, one
chunk's float32 logits and gradient, and the head's float32 gradient.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gptrain.distributed.host import keep_freed_memory
from gptrain.model.losses import chunk_rows
from gptrain.training.choices import FULL_LOGITS_BYTES, Shapes
from gptrain.training.timing import cpu_now, crowding_since, loss_run

HEAD = Shapes(1, 1, 1, 768, 12, vocab=50257, padded_vocab=50304)


def extra_gib(path: str, rows: int, chunk: int) -> float:
    v = HEAD.padded_vocab
    if path == "full":
        return rows * v * FULL_LOGITS_BYTES / 2**30
    return (2 * min(chunk, rows) * v * 4 + v * HEAD.n_embd * 4) / 2**30


def timings(runs: dict, rounds: int) -> dict[str, list[float]]:
    times = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm-up
    for r in range(rounds):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rows", default="1024,4096")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="also time both paths compiled")
    args = p.parse_args()
    if args.device == "cpu":
        keep_freed_memory()
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads")
    print("| rows | dtype | compiled | chunked ms | full ms | full / chunked | extra memory chunked, full |")  # fmt: skip
    print("|---:|---|---|---:|---:|---:|---|")
    start = cpu_now()
    for rows in (int(r) for r in args.rows.split(",")):
        for dtype in args.dtypes.split(","):
            for compiled in (False, True) if args.compile else (False,):
                chunk = chunk_rows(rows, HEAD.padded_vocab, None, compiled)
                paths = ("chunked", "full")
                runs = {q: loss_run(args.device, HEAD, rows, chunk, dtype, q, compiled) for q in paths}  # fmt: skip
                t = timings(runs, args.rounds)
                c, f = (statistics.median(t[q]) for q in paths)
                ratio = statistics.median(
                    b / a for a, b in zip(t["chunked"], t["full"], strict=True)
                )
                mem = ", ".join(f"{extra_gib(q, rows, chunk):.2f} GiB" for q in paths)
                print(f"| {rows} | {dtype} | {'yes' if compiled else 'no'} | {c * 1e3:.0f} | {f * 1e3:.0f} | {ratio:.2f}x | {mem} |")  # fmt: skip
                del runs
    if args.device == "cpu":
        print(f"other processes took {crowding_since(start):.2f} CPU cores on average meanwhile")


if __name__ == "__main__":
    main()
