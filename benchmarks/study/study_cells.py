"""The study's cells: the model sizes, the horizons, each cell's steps and overrides, the races
of a cell, where a cell's tuning lives, and one run's projected CPU seconds (benchmarks/study/study.py,
docs/study.md)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from gptrain.config.load import load_config

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "configs/study_baseline.toml"  # the batch, the evaluation: every arm's the same
TOKENS_PER_PARAM = 20  # compute-optimal (Hoffmann et al.), counted on the blocks' parameters
EVALS = 5  # evaluations per run at 1x (and at the end)
EVAL_COST = 1 / 3  # an evaluated token's time / a trained token's (forward only), an estimate
ARMS = ("baseline", "recipe", "ablation", "nanochat", "nanochat_adamw")
NANOCHAT = ("nanochat", "nanochat_adamw")  # nanochat's block; the others GPT-2's


@dataclass(frozen=True)
class Size:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    dtype: str  # train.dtype and train.attention, pinned: see PINNED
    attention: str

    @property
    def block_params(self) -> int:
        """Weights and biases of the blocks: attention 4d^2 + 4d, MLP 8d^2 + 5d, LayerNorms 4d."""
        d = self.n_embd
        return self.n_layer * (12 * d * d + 13 * d)

    def overrides(self) -> list[str]:
        return [f"model.n_layer={self.n_layer}", f"model.n_embd={self.n_embd}",
                f"model.n_head={self.n_head}", f"train.dtype={self.dtype}",
                f"train.attention={self.attention}", *PINNED]  # fmt: skip


# Every run of a size trains with the same numerics on every machine: `auto` would time the
# choices on each run's CPU, and a cell tuned or raced across machines (or under load: a timing
# can flip between near-equal choices) would mix float32 and bf16 runs. The values are what auto
# picked on an idle Intel Xeon with AMX (large: bf16 autocast and the matmul attention, 1.2x
# float32's speed; small: float32 and SDPA, within 12% of bf16 there and native on every tier).
PINNED = ("train.loss=chunked", "optim.muon_dtype=float32")
SIZES = {
    "small": Size("small", 4, 64, 4, "float32", "sdpa"),
    "large": Size("large", 4, 96, 6, "bfloat16", "matmul"),
}  # head size 16


@functools.cache
def base_config():
    """The study's base config, read once (the plan asks for its batch thousands of times)."""
    return load_config(str(BASE))


def batch_tokens() -> int:
    return base_config().train.total_batch_size


@dataclass(frozen=True)
class Cell:
    corpus: str
    size: Size
    horizon: int  # x the compute-optimal tokens

    @property
    def name(self) -> str:
        return f"{self.corpus}-{self.size.name}-{self.horizon}x"

    @property
    def steps(self) -> int:
        return round(self.horizon * TOKENS_PER_PARAM * self.size.block_params / batch_tokens())

    def overrides(self, data_dir: Path) -> list[str]:
        every = max(1, self.steps // EVALS)
        return [f"data.dir={data_dir}", *self.size.overrides(), f"train.max_steps={self.steps}",
                f"eval.every={every}", f"checkpoint.every={max(every, self.steps // 4)}"]  # fmt: skip


ORDER = ("small-1x", "large-1x", "small-4x")  # cheapest first


def cells(corpora: list[str], names: tuple[str, ...] = ORDER) -> list[Cell]:
    """The cells of `names` in ORDER, corpus by corpus: a name is a kind of cell (large-1x: on
    every corpus of `corpora`) or one cell (code-large-1x: on its corpus, when in `corpora`)."""
    out = []
    for kind in ORDER:
        size, horizon = SIZES[kind.split("-")[0]], int(kind.split("-")[1][:-1])
        out += [Cell(c, size, horizon) for c in corpora if kind in names or f"{c}-{kind}" in names]
    return out


def known(names: tuple[str, ...], corpora: list[str]) -> list[str]:
    """The names of `names` that are neither a kind of cell nor a cell of `corpora`."""
    cell_names = {f"{c}-{k}" for c in corpora for k in ORDER}
    return [n for n in names if n not in ORDER and n not in cell_names]


def tune_cell(corpus: str) -> Cell:
    """The cell every arm is tuned at unless --tune-cells names another: small at 1x."""
    return Cell(corpus, SIZES["small"], 1)


def tuning_dir(out: Path, cell: Cell) -> Path:
    """A cell's tuning folder: OUT/tuning/<corpus> for the tuning cell, else OUT/tuning/<cell>."""
    return out / "tuning" / (cell.corpus if cell == tune_cell(cell.corpus) else cell.name)


def run_seconds(cell: Cell, speed: dict, multiple: float = 1.0) -> float:
    """One run's projected CPU seconds: its start-up, training, and evaluations (eval.tokens
    each), at `speed` (a size's measured tok_per_cpu_s and start_cpu_s)."""
    tokens = cell.steps * multiple * batch_tokens()
    evals = int(cell.steps * multiple) // max(1, cell.steps // EVALS) + 1
    eval_tokens = base_config().eval.tokens
    work = tokens + evals * eval_tokens * EVAL_COST
    return speed["start_cpu_s"] + work / speed["tok_per_cpu_s"]


def multiples(text: str) -> list[float]:
    return [float(m) for m in text.split(",")]


RACES = {  # a cell's races: folder -> (the laddered arm, the other arm at 1x), in running order
    "baseline-ladder": ("baseline", "ablation"),
    "recipe-ladder": ("recipe", "baseline"),
    "nanochat-ladder": ("nanochat", "recipe"),
    "nanochat_adamw-on-baseline-ladder": ("baseline", "nanochat_adamw"),
}


def race_specs(args) -> list[tuple[str, str, tuple[str, str]]]:
    """The cell's races of the arms in args.arms, (folder, ladder, (the laddered arm, the other
    arm)): the baseline's ladder measures the ablation and nanochat_adamw against it; the
    recipe's ladder measures the baseline against the recipe, whose multiplier is the inverse
    (the tokens the recipe needs for the baseline's loss); nanochat's ladder measures the recipe
    against nanochat's block with the recipe, inverted alike (the block's multiplier)."""
    arms = getattr(args, "arms", ARMS)
    ladder = {"baseline": args.baseline_ladder, "recipe": args.recipe_ladder}
    ladder["nanochat"] = args.recipe_ladder  # nanochat's block with the recipe: the recipe's
    return [
        (folder, ladder[pair[0]], pair)
        for folder, pair in RACES.items()
        if pair[0] in arms and pair[1] in arms
    ]


def ladders(args) -> dict[str, list[float]]:
    """Each laddered arm's multiples (race_specs's ladders)."""
    return {arms[0]: multiples(ladder) for _, ladder, arms in race_specs(args)}
