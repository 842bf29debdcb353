"""The recipe against llm.c's by time on one GPU (docs/race.md, "GPT-2 124M"): GPT-2 124M with
configs/gpt2_124m.toml (Muon + wsd) trained for T, and configs/gpt2_124m_llmc.toml (llm.c's
AdamW) for T and 2T, one seed each. Every run is a complete schedule stretched over its
`train.time_budget` (warmup the same share of it as of max_steps, the decay ending with the
budget), 2^17-token steps, and ends with the val loss on the same held-out tokens.

    python benchmarks/gpu/gpu_recipe.py --budget 60s --out gpu_recipe   # one CUDA GPU, ~8 min
    python benchmarks/gpu/gpu_recipe.py --dry-run                       # CPU, tiny model, seconds

Data: `--data DIR`, a prepared folder (GPT-2 tokenizer); else one is prepared once into OUT/data
from the Python sources of this machine's site-packages (no network; the GPT-2 tokenizer's files
offline as docs/data.md says: GPTRAIN_GPT2_DIR or the gptrain cache). A run whose summary.json
exists is not trained again: the same command after a stop trains only what is missing. Prints
one markdown table: config, budget, steps, tokens, tok/s, val loss; and whether the recipe at T
ends below llm.c's at 2T (then it needs under half the time, and under half the tokens when the
step rates are close; see the table).
"""

from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
from pathlib import Path

from gptrain.config.fields import duration_s

run_command = subprocess.run  # how commands start (tests swap in tests/forked.py's)
REPO = Path(__file__).resolve().parents[2]
RECIPE, LLMC = "configs/gpt2_124m.toml", "configs/gpt2_124m_llmc.toml"
CORPUS_BYTES = 250 * 2**20  # Python sources for ~70M GPT-2 tokens: no token read twice at 2T


def sources(limit: int) -> list[Path]:
    """This machine's site-packages `.py` files in a fixed order, up to `limit` bytes in all."""
    roots = sorted({Path(p) for p in site.getsitepackages() if Path(p).is_dir()})
    out, total = [], 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if total >= limit:
                return out
            out.append(path)
            total += path.stat().st_size
    return out


def prepare(out: Path, dry: bool) -> Path:
    """OUT/data, prepared once: the sources as one text file a document each."""
    data = out / "data"
    if (data / "manifest.json").is_file():
        return data
    text = out / "corpus"
    text.mkdir(parents=True, exist_ok=True)
    for i, path in enumerate(sources(2 * 2**20 if dry else CORPUS_BYTES)):
        (text / f"{i:06d}.py.txt").write_text(path.read_text(encoding="utf-8", errors="replace"))
    tokenizer = "byte" if dry else "gpt2"
    gptrain(["prepare", "--input", str(text), "--out", str(data), "--tokenizer", tokenizer])
    return data


def command(cmd: list[str], who: str = "gpu_recipe", cwd: Path = REPO) -> str:
    """One command (the GPU scripts' shared runner): its stdout; its output's end, and a stop, when
    it fails. `who` names the script in its lines."""
    print(f"{who}: {' '.join(cmd[1:4] + cmd[-6:])} ...", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = run_command(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{who}: failed: {' '.join(cmd)}\n{(done.stdout + done.stderr)[-3000:]}")  # fmt: skip
    return done.stdout


def gptrain(args: list[str], who: str = "gpu_recipe") -> str:
    """One gptrain command; its output kept, and shown (its end) when it fails."""
    return command([sys.executable, "-m", "gptrain", *args], who)


def overrides(dry: bool) -> list[str]:
    """What every run shares beside its config: 2^17-token steps, one evaluation at the end on
    2M held-out tokens, no HellaSwag (it needs its data), no checkpoints but the last."""
    common = ["--train.total_batch_size=131072", "--eval.every=0", "--eval.tokens=2097152"]
    common += ["--eval.hellaswag=", "--eval.sample_every=0", "--checkpoint.every=0"]
    common += ["--log.progress=false", "--log.every=10"]
    if dry:  # the same commands on a tiny model: the script's own logic, on a CPU
        common = ["--model.preset=tiny", "--train.seq_len=64", "--train.micro_batch_size=4"]
        common += ["--train.total_batch_size=1024", "--train.device=cpu", "--data.tokenizer=byte"]
        common += ["--train.dtype=float32", "--train.compile=false", "--eval.every=0"]
        common += ["--eval.tokens=4096", "--eval.hellaswag=", "--eval.sample_every=0"]
        common += ["--checkpoint.every=0", "--log.progress=false"]
    return common


def train(name: str, config: str, budget_s: float, data: Path, out: Path, dry: bool) -> dict:
    """One run (OUT/<name>), or its summary when it has finished; with its budget."""
    run_dir = out / f"{name}-{budget_s:g}s"
    if not (run_dir / "summary.json").is_file():
        args = ["train", "--config", config, f"--data.dir={data}", f"--run.dir={run_dir}"]
        gptrain([*args, f"--train.time_budget={budget_s:g}s", *overrides(dry)])
    return {"name": name, "budget_s": budget_s, **json.loads((run_dir / "summary.json").read_text())}  # fmt: skip


def train_tokens(data: Path) -> int:
    manifest = json.loads((data / "manifest.json").read_text())
    return int(manifest["splits"]["train"]["tokens"])


def table(rows: list[dict], train: int) -> str:
    lines = [
        "| run | budget | steps | tokens | tok/s | val loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['budget_s']:g} s | {r['steps']:,} | {r['tokens']:,} | {r['tok_per_s']:,.0f} | {r['val_loss']:.4f} |")  # fmt: skip
    recipe, base, base2 = rows
    below = recipe["val_loss"] < base2["val_loss"]
    lines.append("")
    lines.append(
        f"the recipe at T ends {'below' if below else 'above'} llm.c's at 2T "
        f"({recipe['val_loss']:.4f} against {base2['val_loss']:.4f}; llm.c's at T {base['val_loss']:.4f})"
    )
    passes = max(r["tokens"] for r in rows) / train
    lines.append(f"the train split: {train:,} tokens; the longest run reads it {passes:.2f} times")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", default=None, help="T, the recipe's training time (llm.c's: T and 2T): 60s; dry run 4s")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("gpu_recipe"), help="the runs' folder")
    p.add_argument("--data", type=Path, default=None, help="a prepared folder (GPT-2 tokenizer)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, a few seconds a run")
    a = p.parse_args(argv)
    text = a.budget or ("4s" if a.dry_run else "60s")
    budget = duration_s(text)
    if budget is None:
        print(f"gpu_recipe: --budget {text!r} is not a duration; write it as 60s or 2m")
        return 2
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_recipe: no CUDA device here; use --dry-run to check the script on a CPU")
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    data = a.data or prepare(a.out, a.dry_run)
    runs = [("recipe@T", RECIPE, budget), ("llmc@T", LLMC, budget), ("llmc@2T", LLMC, 2 * budget)]
    rows = [train(name, config, b, data, a.out, a.dry_run) for name, config, b in runs]
    print(table(rows, train_tokens(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
