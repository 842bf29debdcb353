"""GPT-2's block against nanochat's at 124M on one GPU, with nanoGPT's train.py beside them.

    python benchmarks/gpu/gpu_blocks.py --nanogpt DIR --out gpu_blocks   # one CUDA GPU, ~8 min
    python benchmarks/gpu/gpu_blocks.py --dry-run --out /tmp/gpu_blocks  # CPU, tiny models

1. `gptrain bench` of configs/gpt2_124m.toml and configs/nanochat_124m.toml on synthetic tokens
   (GPT-2's vocabulary, their own dtype and compile: bf16, compiled), 2^17-token steps: tok/s,
   MFU against the peak measured in the same run, peak memory.
2. nanoGPT's own train.py (`--nanogpt DIR`, a checkout of github.com/karpathy/nanoGPT) at its
   GPT-2 124M defaults (no biases, vocabulary 50304), the same micro-batch and tokens per step,
   compiled, bf16, on random tokens: tok/s over its last iterations and peak memory.
3. The two presets trained for the same `--steps` steps of 2^17 tokens on the same data (this
   machine's Python sources, GPT-2 tokens; prepared while 1 and 2 run), warmup the same share of
   the run as in each preset, and the val loss of each on the same held-out tokens.

Every part prints its table when done; results go to OUT/blocks.json. A part whose results are
in OUT (bench_*.json, nanogpt.json, a run's summary.json) is not run again: the same command after
a stop runs only what is missing. `GPTRAIN_GPT2_DIR` names the GPT-2 tokenizer's files
where the node has no cache (docs/data.md).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_recipe  # noqa: E402  (its runner; its data: the machine's Python sources)

REPO = Path(__file__).resolve().parents[2]
BLOCKS = {"gpt2": "configs/gpt2_124m.toml", "nanochat": "configs/nanochat_124m.toml"}
BATCH = 131072  # tokens per step: 2 micro-batches of 64 x 1024
NANOGPT_RUNNER = (
    "import runpy, sys, torch; sys.argv = ['train.py', *sys.argv[1:]]; "
    "runpy.run_path('train.py', run_name='__main__'); "
    "print('peak_mem_mib', torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0)"
)


def run(cmd: list[str], cwd: Path = REPO) -> str:
    return gpu_recipe.command(cmd, "gpu_blocks", cwd)


def shapes(dry: bool) -> list[str]:
    """Overrides every gptrain command shares: the dry run's tiny model on a CPU."""
    if not dry:
        return [f"--train.total_batch_size={BATCH}"]
    return ["--model.preset=", "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=64", "--train.seq_len=64",
            "--train.micro_batch_size=4", "--train.total_batch_size=512", "--train.device=cpu",
            "--train.dtype=float32", "--train.compile=false", "--data.tokenizer=byte"]  # fmt: skip


def bench(out: Path, dry: bool) -> list[dict]:
    rows = []
    for name, config in BLOCKS.items():
        path = out / f"bench_{name}.json"
        steps = ["--steps", "2", "--warmup", "1"] if dry else ["--steps", "10", "--warmup", "3"]
        if not path.is_file():
            run([sys.executable, "-m", "gptrain", "bench", "--config", config, *steps,
                 "--json", str(path), *shapes(dry)])  # fmt: skip
        rows.append({"name": name, **json.loads(path.read_text())[0]})
    return rows


def nanogpt(folder: Path, out: Path, dry: bool) -> dict:
    """nanoGPT's train.py on random tokens: its iteration times, its peak memory (OUT/nanogpt.json)."""
    import numpy as np

    saved = out / "nanogpt.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    data = folder / "data" / "gptrain_random"
    data.mkdir(parents=True, exist_ok=True)
    tokens = np.random.default_rng(0).integers(0, 50257, 2**22, dtype=np.uint16)
    for split in ("train", "val"):
        tokens.tofile(data / f"{split}.bin")
    mb, seq, accum, iters = (4, 64, 2, 12) if dry else (64, 1024, 2, 30)
    args = [f"--dataset={data.name}", f"--batch_size={mb}", f"--block_size={seq}",
            f"--gradient_accumulation_steps={accum}", f"--max_iters={iters}", "--eval_interval=100000",
            "--eval_iters=1", "--log_interval=1", "--always_save_checkpoint=False", "--wandb_log=False",
            f"--out_dir={data / 'out'}"]  # fmt: skip
    if dry:
        args += ["--device=cpu", "--compile=False", "--dtype=float32", "--n_layer=2", "--n_head=2"]
        args += ["--n_embd=64"]
    text = run([sys.executable, "-c", NANOGPT_RUNNER, *args], cwd=folder)
    ms = [float(m) for m in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", text, re.M)]
    last = ms[len(ms) // 2 :]  # past compilation and warm-up
    step_s = sum(last) / len(last) / 1e3
    peak = float(re.findall(r"^peak_mem_mib ([\d.]+)", text, re.M)[-1])
    row = {"name": "nanoGPT", "tok_per_s": mb * seq * accum / step_s, "step_ms": step_s * 1e3,
           "peak_mem_mib": peak, "iterations_timed": len(last)}  # fmt: skip
    saved.write_text(json.dumps(row))
    return row


def race(data: Path, out: Path, steps: int, dry: bool) -> list[dict]:
    """Each preset for `steps` steps on the same data; warmup scaled with the run."""
    from gptrain.config.load import load_config

    rows = []
    for name, config in BLOCKS.items():
        cfg = load_config(config)
        warmup = round(cfg.optim.warmup_steps * steps / cfg.train.max_steps)
        run_dir = out / f"race_{name}"
        if not (run_dir / "summary.json").is_file():
            args = ["train", "--config", config, f"--data.dir={data}", f"--run.dir={run_dir}"]
            args += [f"--train.max_steps={steps}", f"--optim.warmup_steps={warmup}"]
            args += [
                "--eval.every=0",
                f"--eval.tokens={8192 if dry else 2**21}",
                "--eval.hellaswag=",
            ]
            args += ["--eval.sample_every=0", "--checkpoint.every=0", "--log.progress=false"]
            run([sys.executable, "-m", "gptrain", *args, *shapes(dry)])
        summary = json.loads((run_dir / "summary.json").read_text())
        rows.append({"name": name, "warmup": warmup, **summary})
    return rows


def tables(result: dict) -> str:
    lines = ["| block | tok/s | MFU | step ms | peak memory MiB |", "|---|---:|---:|---:|---:|"]
    for r in result.get("bench", []) + ([result["nanogpt"]] if "nanogpt" in result else []):
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else ""
        lines.append(f"| {r['name']} | {r['tok_per_s']:,.0f} | {mfu} | {r['step_ms']:.1f} | {r.get('peak_mem_mib', 0):,.0f} |")  # fmt: skip
    if "race" in result:
        lines += ["", "| block | steps | tokens | warmup | tok/s | val loss |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in result["race"]:
            lines.append(f"| {r['name']} | {r['steps']:,} | {r['tokens']:,} | {r['warmup']} | {r['tok_per_s']:,.0f} | {r['val_loss']:.4f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("gpu_blocks"), help="the runs' folder")
    p.add_argument("--nanogpt", type=Path, default=None, help="a nanoGPT checkout (its train.py)")
    p.add_argument("--steps", type=int, default=200, help="each block's training steps in the race")
    p.add_argument("--data", type=Path, default=None, help="a prepared folder (GPT-2 tokenizer)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models, seconds a part")
    a = p.parse_args(argv)
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_blocks: no CUDA device here; use --dry-run to check the script on a CPU")
        return 2
    if a.nanogpt and not (a.nanogpt / "train.py").is_file():
        print(f"gpu_blocks: --nanogpt {a.nanogpt}: no train.py there; give a nanoGPT checkout")
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    prepared: dict = {}
    if a.data is None:  # on the CPU while the GPU benches
        worker = threading.Thread(target=lambda: prepared.update(d=gpu_recipe.prepare(a.out, a.dry_run)))  # fmt: skip
        worker.start()
    result: dict = {"bench": bench(a.out, a.dry_run)}
    if a.nanogpt:
        result["nanogpt"] = nanogpt(a.nanogpt.resolve(), a.out, a.dry_run)
    print(tables(result), flush=True)
    if a.data is None:
        worker.join()
    data = a.data or prepared["d"]
    result["race"] = race(data, a.out, a.steps, a.dry_run)
    (a.out / "blocks.json").write_text(json.dumps(result, indent=1))
    print(tables(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
