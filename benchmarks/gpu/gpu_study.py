"""The study's cell at a size a 2-core CPU cannot reach, on one GPU: tuned AdamW at T against the
recipe at T/4, T/2 and T (docs/study.md; benchmarks/study/).

    python benchmarks/gpu/gpu_study.py --out gpu_study                  # one CUDA GPU
    python benchmarks/gpu/gpu_study.py --dry-run --out /tmp/gpu_study   # CPU, tiny model

The cell: 6 layers of width 256 (4 heads of 64; 4.74M parameters in the blocks), byte-level code
(this machine's Python sources, prepared once into OUT/data), 2^17-token steps of micro-batch 512
in bf16, eager (at this size compiling each run costs more than it saves), T =
--tokens-per-param x the blocks' parameters. The arms are the study's configs
(configs/study_baseline.toml, configs/study_recipe.toml) at the best points of the study's
code-large-1x tuning (BEST below, 4 x 96 on a CPU). AdamW's best lr moves with width, so the
baseline's lr is tuned again here first: the carried lr and the carried lr x 96/256, one seed each
at T, the lower final val loss wins. Then

    gptrain race --config recipe.toml --config baseline.toml --ladder 0.25,0.5,1 --seeds S

whose table gives the tokens at which the recipe reaches the baseline's loss at T (the crossing,
its inverse the multiplier) with the race's coverage-tested interval. A run whose summary.json
exists is not trained again, and the race resumes: the same command after a stop trains only
what is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_recipe  # noqa: E402  (its runner; the machine's Python sources in a fixed order)

REPO = Path(__file__).resolve().parents[2]
N_LAYER, N_EMBD, N_HEAD = 6, 256, 4
BLOCK_PARAMS = N_LAYER * (12 * N_EMBD * N_EMBD + 13 * N_EMBD)  # weights and biases of the blocks
BATCH = 131072
WIDTH_RATIO = 96 / N_EMBD  # the tuned cell's width over this one's
BEST = {  # studies/deciding/tuning/code-large-1x: each arm's best trial (warmup: a share of T)
    "baseline": ("configs/study_baseline.toml", {"optim.lr": 8e-3, "optim.min_lr": 8e-4,
                 "optim.weight_decay": 0.1, "optim.beta2": 0.95}, 0.2),
    "recipe": ("configs/study_recipe.toml", {"optim.muon_lr": 0.01, "optim.lr": 4e-3,
               "optim.decay_fraction": 0.2}, None),
}  # fmt: skip


def gptrain(args: list[str]) -> str:
    return gpu_recipe.gptrain(args, "gpu_study")


def prepare(out: Path, tokens: int) -> Path:
    """OUT/data: the sources, byte-level, enough that no run reads a token twice."""
    data = out / "data"
    if not (data / "manifest.json").is_file():
        text = out / "corpus"
        text.mkdir(parents=True, exist_ok=True)
        for i, path in enumerate(gpu_recipe.sources(int(tokens * 1.1))):
            (text / f"{i:06d}.py.txt").write_text(
                path.read_text(encoding="utf-8", errors="replace")
            )
        gptrain(["prepare", "--input", str(text), "--out", str(data), "--tokenizer", "byte"])
    return data


def cell(data: Path, steps: int, dry: bool) -> list[str]:
    """The cell's overrides, every arm the same: size, batch, steps, evaluation."""
    every = max(1, steps // 5)
    o = [f"data.dir={data}", f"model.n_layer={N_LAYER}", f"model.n_embd={N_EMBD}",
         f"model.n_head={N_HEAD}", f"train.total_batch_size={BATCH}", f"train.max_steps={steps}",
         f"eval.every={every}", "eval.tokens=1048576", f"checkpoint.every={steps}",
         "train.micro_batch_size=512", "train.device=cuda", "train.compile=false"]  # fmt: skip
    if dry:
        o += ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "train.total_batch_size=1024",
              "train.micro_batch_size=4", "train.device=cpu", "train.compile=false",
              "eval.tokens=4096", "train.dtype=float32"]  # fmt: skip
    return o


def write_config(out: Path, name: str, base: str, values: dict, o: list[str], steps: int) -> Path:
    from gptrain.config.load import load_config, to_toml

    path = out / "configs" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = [f"{k}={v!r}" for k, v in values.items()]
    path.write_text(to_toml(load_config(base, [*o, *keys, f"run.dir={out / 'runs' / name}"])))
    return path


def final_loss(config: Path, run_dir: Path) -> float:
    if not (run_dir / "summary.json").is_file():
        gptrain(["train", "--config", str(config), f"--run.dir={run_dir}", "--train.seed=1"])
    return json.loads((run_dir / "summary.json").read_text())["val_loss"]


def tune_baseline(out: Path, o: list[str], steps: int) -> tuple[Path, dict]:
    """The carried lr against it scaled by the widths; the lower val loss at T (seed 1)."""
    base, values, warmup = BEST["baseline"]
    tried = {}
    for factor in (1.0, WIDTH_RATIO):
        lr = values["optim.lr"] * factor
        v = {**values, "optim.lr": lr, "optim.min_lr": lr / 10}
        v["optim.warmup_steps"] = round(warmup * steps)
        config = write_config(out, f"baseline_lr{lr:.3g}", base, v, o, steps)
        tried[config] = final_loss(config, out / "tuning" / config.stem)
    best = min(tried, key=tried.get)
    return best, {c.stem: loss for c, loss in tried.items()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("gpu_study"), help="the runs' folder")
    p.add_argument("--tokens-per-param", type=float, default=20.0, help="T over the blocks' parameters")  # fmt: skip
    p.add_argument("--seeds", type=int, default=2, help="seeds per rung of the race (>= 2)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, seconds a run")
    a = p.parse_args(argv)
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_study: no CUDA device here; use --dry-run to check the script on a CPU")
        return 2
    if a.seeds < 2 or a.tokens_per_param <= 0:
        print("gpu_study: --seeds must be at least 2 and --tokens-per-param above 0")
        return 2
    tokens = 16384 if a.dry_run else int(a.tokens_per_param * BLOCK_PARAMS)
    steps = max(8, round(tokens / (1024 if a.dry_run else BATCH)))
    a.out.mkdir(parents=True, exist_ok=True)
    data = prepare(a.out, 2**21 if a.dry_run else steps * BATCH)
    o = cell(data, steps, a.dry_run)
    baseline, tuned = tune_baseline(a.out, o, steps)
    base, values, _ = BEST["recipe"]
    recipe = write_config(a.out, "recipe", base, values, o, steps)
    print(f"gpu_study: T = {steps} steps x {BATCH if not a.dry_run else 1024} tokens; baseline lr at T: {tuned}", flush=True)  # fmt: skip
    race = ["race", "--config", str(recipe), "--config", str(baseline), "--ladder", "0.25,0.5,1"]
    table = gptrain([*race, "--seeds", str(a.seeds), "--out", str(a.out / "race")])
    print(table)
    (a.out / "tuned.json").write_text(json.dumps({"steps": steps, "baseline_lr": tuned}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
