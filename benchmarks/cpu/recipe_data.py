"""The datasets the recipe presets were tuned and raced on (docs/race.md, "The recipe").

    python benchmarks/cpu/recipe_data.py --out data

writes three prepared folders (GPT-2 tokenizer):

- `data/plays-gpt2-tune`: for tuning. The built-in corpus's 38 plays in a seeded order: the first
  4 are held out and never seen here; of the other 34, 3 are this folder's val split and 31 its
  train split.
- `data/plays-gpt2`: for the report. Train: those 34 plays; val: the 4 held-out plays, used once.
- `data/stdlib-gpt2`: a corpus no preset was tuned on, which every machine has: this Python's
  standard library modules (the top-level `*.py` files of `sysconfig`'s stdlib folder), one
  document each; files drawn in a seeded order until they hold 10% of the tokens are its val
  split (`gptrain prepare`'s default).

The plays are written as text files under `OUT/recipe-texts/` first, so that the splits are plain
folders of files that `gptrain prepare` reads as documents.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import sysconfig
from pathlib import Path

from gptrain.data.sources import shakespeare_documents

HELD_OUT, TUNE_VAL = 4, 3  # plays


def write_plays(texts: Path, seed: int) -> dict[str, Path]:
    """The plays in a seeded order, split into held-out / tune-val / tune-train folders."""
    docs = shakespeare_documents()
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    parts = {
        "heldout": order[:HELD_OUT],
        "tuneval": order[HELD_OUT : HELD_OUT + TUNE_VAL],
        "tunetrain": order[HELD_OUT + TUNE_VAL :],
    }
    folders = {}
    for part, idx in parts.items():
        folder = texts / part
        folder.mkdir(parents=True, exist_ok=True)
        for i in idx:
            name, text = docs[i]
            (folder / (Path(name).stem + ".txt")).write_text(text, encoding="utf-8")
        folders[part] = folder
    return folders


def prepare(out: Path, inputs: list[Path], val: list[Path] | None = None) -> None:
    if out.exists() and any(out.iterdir()):
        print(f"{out}: exists, kept", file=sys.stderr)
        return
    cmd = [sys.executable, "-m", "gptrain", "prepare", "--out", str(out), "--tokenizer", "gpt2"]
    cmd += ["--no-progress", "--input", *map(str, inputs)]
    if val:
        cmd += ["--val-input", *map(str, val)]
    subprocess.run(cmd, check=True)


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data", help="folder for the prepared datasets")
    ap.add_argument("--seed", type=int, default=0, help="seed of the plays' order")
    args = ap.parse_args()
    out = Path(args.out)
    f = write_plays(out / "recipe-texts", args.seed)
    prepare(out / "plays-gpt2-tune", [f["tunetrain"]], [f["tuneval"]])
    prepare(out / "plays-gpt2", [f["tunetrain"], f["tuneval"]], [f["heldout"]])
    prepare(out / "stdlib-gpt2", stdlib_files())
    return 0


if __name__ == "__main__":
    sys.exit(main())
