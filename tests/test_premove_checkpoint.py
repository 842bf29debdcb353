"""A checkpoint written by gptrain before the package moved into folders (issue 17) resumes after
the move, bit for bit.

The fixture was made at commit 1e4254a (the last flat-layout commit) with
    gptrain train --config configs/debug.toml --data.dir=DATA --model.n_layer=1 --model.n_embd=32
        --model.n_head=2 --train.max_steps=12 --checkpoint.every=6 --eval.every=6
        --eval.tokens=2048 --eval.sample_every=0 --log.every=3
where DATA is tiny shakespeare prepared with the byte tokenizer (what the `byte_data` fixture
prepares). tests/fixtures/premove_run holds that run's step-6 checkpoint; premove_step12_model.safetensors
is the same uninterrupted run's final (step 12) weights, computed on an AMD EPYC whose torch
reports the AVX512 capability: float32 kernels of another ISA (AVX2: the same run measured
different bits from step 7 on) round differently, so the comparison runs where the capability is
the fixture's.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gptrain.checkpoint import manager as checkpoint
from gptrain.commands.train import train
from gptrain.config.load import load_config
from gptrain.distributed.runtime import DistInfo

FIXTURES = Path(__file__).resolve().parent / "fixtures"
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
    "train.attention=sdpa",  # what auto meant in float32 before the move (now it is measured)
]


FIXTURE_CAPABILITY = "AVX512"


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != FIXTURE_CAPABILITY,
    reason=f"the reference weights were computed with {FIXTURE_CAPABILITY} kernels; this CPU's "
    f"{torch.backends.cpu.get_cpu_capability()} kernels round float32 differently",
)
def test_premove_checkpoint_resumes_bit_for_bit(byte_data, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / "premove_run", run_dir)
    cfg = load_config(DEBUG, [f"data.dir={byte_data}", f"run.dir={run_dir}", *OVERRIDES])
    train(cfg, DistInfo())
    # it resumed (a fresh run would log steps 3 and 6 too, and would end with the same weights)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [9, 12]
    final = checkpoint.find(run_dir)
    assert final.name == "step_00000012"
    got = load_file(str(final / "model.safetensors"))  # as written: the tied head stored once
    want = load_file(str(FIXTURES / "premove_step12_model.safetensors"))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
