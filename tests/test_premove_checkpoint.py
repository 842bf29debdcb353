"""A checkpoint written before the package moved into folders (the flat layout) resumes today,
exactly.

tests/fixtures/premove_run holds a real step-6 checkpoint that the flat-layout gptrain wrote with
    gptrain train --config configs/debug.toml --data.dir=DATA --model.n_layer=1 --model.n_embd=32
        --model.n_head=2 --train.max_steps=12 --checkpoint.every=6 --eval.every=6
        --eval.tokens=2048 --eval.sample_every=0 --log.every=3
(DATA: tiny shakespeare prepared with the byte tokenizer, what the `byte_data` fixture prepares).
It is the reference for what the old layout is: its files, the keys of its meta.json (no
speed_choices), of its model and config, and of its state.pt's data cursor and train state (no
spike detector). Its weights came from one torch build on one CPU, and float32 kernels of other
builds and ISAs round differently, so its numbers are no oracle for another machine; the oracle is
computed here instead, on this torch and this CPU:

- one uninterrupted run of 12 steps (checkpoints at steps 6 and 12);
- its step-6 checkpoint resumed as written today, and the same checkpoint converted into the old
  layout (its files reduced to what the fixture holds) and resumed;
- the three step-12 checkpoints hold the same weights and optimizer state, bit for bit.

The fixture itself must still load and train on to step 12 (the real files, torch's optimizer
format of its day included).
"""

import hashlib
import json
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gptrain.checkpoint import manager as checkpoint
from gptrain.commands.train import train
from gptrain.config.load import load_config
from gptrain.distributed.runtime import DistInfo

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "premove_run"
DEBUG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")
OVERRIDES = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "train.max_steps=12",
    "checkpoint.every=6",
    "eval.every=6",
    "eval.tokens=2048",
    "eval.sample_every=0",
    "log.every=3",
    "log.progress=false",
    "log.plot=false",
    "train.attention=sdpa",  # what auto meant in float32 before the move (now it is measured)
]
STEP6 = "step_00000006"


def run(byte_data: Path, run_dir: Path) -> Path:
    """Train (or resume) the fixture's run in run_dir; its final checkpoint folder."""
    cfg = load_config(DEBUG, [f"data.dir={byte_data}", f"run.dir={run_dir}", *OVERRIDES])
    train(cfg, DistInfo())
    return checkpoint.find(run_dir)


def read(ckpt: Path) -> tuple[dict, dict]:
    meta = json.loads((ckpt / "meta.json").read_text())
    return meta, torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)


def layout(ckpt: Path) -> dict:
    """What a checkpoint folder's layout fixes: its files; meta.json's keys, format, model keys
    and config sections and keys; state.pt's keys, its data cursor's, train state's and RNG
    states' keys, and the parameter names its optimizer state is keyed by."""
    meta, state = read(ckpt)
    ts = state["train_state"]
    return {
        "files": sorted(p.name for p in ckpt.iterdir()),
        "meta": sorted(meta),
        "format": meta["format"],
        "model": sorted(meta["model"]),
        "config": {s: sorted(keys) for s, keys in tomllib.loads(meta["config"]).items()},
        "state": sorted(state),
        "data": sorted(state["data"]),
        "train_state": sorted(ts),
        "rng": [sorted(r) for r in ts["rng"]],
        "optimizer": sorted(state["optimizer"]),
        "optimizer params": sorted(state["optimizer"]["state"]),
    }


def old_config(text: str, old: dict) -> str:
    """A config TOML (to_toml's one line per key) cut to the old sections and keys."""
    lines, section = [], None
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
            keep = section in old
        else:
            keep = section in old and (not line.strip() or line.split(" = ")[0] in old[section])
        if keep:
            lines.append(line)
    return "\n".join(lines) + "\n"


def to_old_layout(ckpt: Path) -> None:
    """Rewrite a checkpoint written today into the fixture's (flat-layout) layout, in place: every
    key the old layout did not have dropped, and meta.json's record of every file's size and
    sha256 made true again."""
    old_meta, old_state = read(FIXTURE / "checkpoints" / STEP6)
    meta, state = read(ckpt)
    old_sections = {s: set(k) for s, k in tomllib.loads(old_meta["config"]).items()}
    meta = {k: v for k, v in meta.items() if k in old_meta}
    meta["model"] = {k: v for k, v in meta["model"].items() if k in old_meta["model"]}
    meta["config"] = old_config(meta["config"], old_sections)
    state = {k: v for k, v in state.items() if k in old_state}
    for part in ("data", "train_state"):
        state[part] = {k: v for k, v in state[part].items() if k in old_state[part]}
    old_files = {p.name for p in (FIXTURE / "checkpoints" / STEP6).iterdir()}
    for p in ckpt.iterdir():
        if p.name not in old_files:
            p.unlink()
    torch.save(state, ckpt / "state.pt")
    meta["files"] = {}
    for p in sorted(ckpt.iterdir()):
        if p.name != "meta.json":
            data = p.read_bytes()
            meta["files"][p.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def from_step6(source_run: Path, run_dir: Path) -> Path:
    """A run folder holding only source_run's step-6 checkpoint (what the fixture holds)."""
    shutil.copytree(source_run / "checkpoints" / STEP6, run_dir / "checkpoints" / STEP6)
    (run_dir / "checkpoints" / "latest").write_text(STEP6 + "\n")
    return run_dir / "checkpoints" / STEP6


def logged_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


def assert_same_training(got: Path, want: Path) -> None:
    """Two checkpoints of the same step hold the same weights, optimizer state, data cursor and
    step, bit for bit (the tied head is stored once: the files' keys are compared as written)."""
    a, b = load_file(str(got / "model.safetensors")), load_file(str(want / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in b:
        assert torch.equal(a[k], b[k]), f"{got}: weight {k}"
    (_, sa), (_, sb) = read(got), read(want)
    assert sa["data"] == sb["data"]
    for k in ("step", "tokens"):
        assert sa["train_state"][k] == sb["train_state"][k], k
    oa, ob = sa["optimizer"]["state"], sb["optimizer"]["state"]
    assert oa.keys() == ob.keys()
    for name in ob:
        for k in ob[name]:
            assert torch.equal(oa[name][k], ob[name][k]), f"{got}: optimizer {name} {k}"


def test_premove_checkpoint_resumes_bit_for_bit(byte_data, tmp_path):
    whole = run(byte_data, tmp_path / "whole")  # uninterrupted: checkpoints at steps 6 and 12
    assert whole.name == "step_00000012"

    new = from_step6(tmp_path / "whole", tmp_path / "new")
    old = from_step6(tmp_path / "whole", tmp_path / "old")
    to_old_layout(old)
    assert layout(old) == layout(
        FIXTURE / "checkpoints" / STEP6
    )  # the conversion is the old layout
    assert layout(new) != layout(old)  # and today's layout differs from it (else: nothing tested)

    for run_dir in (tmp_path / "new", tmp_path / "old"):
        final = run(byte_data, run_dir)
        # it resumed (a fresh run would log steps 3 and 6 too)
        assert logged_steps(run_dir) == [9, 12], run_dir
        assert final.name == "step_00000012"
        assert_same_training(final, whole)


def fixture_optimizer_is_newer_than_this_torch() -> bool:
    """The fixture's AdamW param groups hold an option this torch's AdamW does not know (torch
    before 2.7 fails to load them: they were written by a newer torch)."""
    _, state = read(FIXTURE / "checkpoints" / STEP6)
    known = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).param_groups[0]
    return bool(set(state["optimizer"]["param_groups"][0]) - set(known) - {"params"})


def test_the_premove_fixture_resumes(byte_data, tmp_path):
    """The real flat-layout files load today and train on from step 6 to step 12."""
    if fixture_optimizer_is_newer_than_this_torch():
        pytest.skip(f"the fixture's optimizer state was written by a newer torch than {torch.__version__}")  # fmt: skip
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    before = load_file(str(run_dir / "checkpoints" / STEP6 / "model.safetensors"))
    final = run(byte_data, run_dir)
    assert logged_steps(run_dir) == [9, 12]
    assert final.name == "step_00000012"
    after = load_file(str(final / "model.safetensors"))
    assert after.keys() == before.keys()
    assert all(after[k].isfinite().all() for k in after)
    assert not all(torch.equal(after[k], before[k]) for k in after)  # it trained on
