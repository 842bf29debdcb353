"""The equivalence matrix: every schedule feature (a row of FEATURES) against the core proofs (the
columns of PROOFS), each pair one test.

    ddp      2 DDP gloo ranks (accumulation 2) == 1 process (accumulation 4)
    fsdp     2 FSDP2 gloo ranks (sharded checkpoints) == 1 process
    resume   1 process killed inside a step (GPTRAIN_FAULT=crash) and rerun == uninterrupted, bit
             for bit (weights, data cursor, the logged lr of every step)

Across processes the tolerance is rtol 1e-5, atol 1e-5 (tests/test_muon_dist.py's; without
test_distributed.py's small clip threshold, AdamW's normalised update lets the order of the
gradient sums show in the 7th digit), the key part of each attention input bias left out as in
tests/train_helpers.py `comparable` (its true gradient is zero); the logged steps and learning rates are equal. Every run is `gptrain train` in
its own process (tests/forked.py), from the same global batches (1024 tokens a step, micro-batch
4), in float32, 6-8 steps of configs/debug.toml, a checkpoint every 2 steps. A run is made once
per module and shared by the proofs that read it; the 2-rank runs pass the replica check
(gptrain/distributed/replicas.py) at each of their checkpoints. A new feature is one new row.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import dist_helpers as h
import forked
import pytest
import torch
from train_helpers import comparable

from gptrain.checkpoint import manager as checkpoint
from gptrain.distributed import faults

pytestmark = pytest.mark.slow

BASE = [*h.FAST, "--train.max_steps=6", "--train.micro_batch_size=4", "--train.total_batch_size=1024"]  # fmt: skip
BASE += ["--checkpoint.every=2", "--checkpoint.keep_last=10"]


@dataclass(frozen=True)
class Feature:
    name: str
    overrides: tuple[str, ...] = ()
    fault: str = ""  # GPTRAIN_FAULT of every run of the feature (a clock, a spike)
    kill_at: int = 5  # the killed run crashes inside this step (after the checkpoint before it)
    branch: tuple[str, ...] = ()  # a second phase: the same run restarted with these overrides
    # across processes: the sums of gradients run in another order (2 ranks x 2 micro-steps vs
    # 4), and AdamW's normalised update turns that rounding of ~0 gradients into ~1e-6 in a
    # weight after a few steps (measured up to 1.2e-6, by tier and loss path)
    atol: float = 1e-5


NANOCHAT = ("--model.arch=nanochat", "--model.n_head=4", "--model.n_kv_head=2")
FEATURES = [
    # every step counts 0.25 s: 6 steps in 1.5 s, the schedule of 8 steps read at the time spent
    Feature("time_budget", ("--train.time_budget=1.5s", "--train.max_steps=8"), "step_time@0.25"),
    Feature("wsd", ("--optim.lr_schedule=wsd", "--optim.decay_fraction=0.5")),
    # float32 orthogonalisation
    Feature(
        "muon", ("--optim.name=muon", "--optim.muon_dtype=float32", "--optim.muon_split=split")
    ),
    # a x20 loss at step 6, detected against the last 4 steps: back to step 4, past 6's batch
    Feature(
        "rollback",
        ("--train.spike=rollback", "--train.spike_window=4", "--train.max_steps=8"),
        "spike@6",
        kill_at=7,
    ),  # fmt: skip
    # to step 6, then back to step 4 with another lr (a new timeline), to step 6 again
    Feature("timeline", branch=("--checkpoint.resume=4", "--optim.lr=1e-3"), kill_at=6),
    # the nanochat block (RMSNorm, RoPE, QK-norm, ReLU^2, untied head, softcap); GQA: 4 query
    # heads of 16 reading 2 key/value heads
    Feature("nanochat", NANOCHAT),
    # ... with Muon on its block matrices, AdamW on the embedding and the untied head
    Feature(
        "nanochat_muon",
        (*NANOCHAT, "--optim.name=muon", "--optim.muon_dtype=float32", "--optim.muon_split=split"),
    ),  # fmt: skip
]
PROOFS = ["ddp", "fsdp", "resume"]


class Runs:
    """Each (feature, variant) trained once: variant single, ddp, fsdp, or killed (1 process:
    the last phase crashed at kill_at, then the same command again)."""

    def __init__(self, root, data):
        self.root, self.data, self.done = root, data, {}

    def get(self, feature: Feature, variant: str):
        key = (feature.name, variant)
        if key not in self.done:
            self.done[key] = self._train(feature, variant, self.root / f"{feature.name}_{variant}")
        return self.done[key]

    def _train(self, feature: Feature, variant: str, run_dir):
        phases = [list(feature.overrides)]
        if feature.branch:
            phases.append([*feature.overrides, *feature.branch])
        for i, overrides in enumerate(phases):
            last = i == len(phases) - 1
            if variant == "killed" and last:
                crash = f"crash@{feature.kill_at}"
                rc, err = self._start(run_dir, overrides, ",".join(filter(None, [feature.fault, crash])), "single")  # fmt: skip
                assert rc == 1 and f"crash at step {feature.kill_at}: exit 1" in err, err[-3000:]
            mode = "single" if variant == "killed" else variant
            rc, err = self._start(run_dir, overrides, feature.fault, mode)
            assert rc == 0, err[-3000:]
        if variant == "killed":  # the rerun resumed from the checkpoint before the crash
            resumed = [x for x in (run_dir / "train.log").read_text().splitlines() if "resumed from" in x]  # fmt: skip
            assert f"step_{(feature.kill_at - 1) // 2 * 2:08d}:" in resumed[-1], resumed[-1]
        return run_dir

    def _start(self, run_dir, overrides, fault: str, mode: str) -> tuple[int, str]:
        args = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={self.data}"]
        args += [f"--run.dir={run_dir}", *BASE, *overrides]
        if mode == "single":
            p = forked.run([sys.executable, *args], env=h.env(**{faults.ENV: fault}), capture_output=True, text=True, timeout=h.TIMEOUT)  # fmt: skip
            return p.returncode, p.stderr
        procs = h.spawn([*args, f"--dist.mode={mode}"], **{faults.ENV: fault})
        results = h.wait_all(procs, h.TIMEOUT)
        bad = [(rc, err) for rc, _, err in results if rc != 0]
        return bad[0] if bad else (0, results[0][2])


@pytest.fixture(scope="module")
def runs(byte_data, tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("matrix"), byte_data)


def logged(run_dir) -> list[tuple[int, float]]:
    """(step, lr) of every logged training step, in order (a rewound step appears once)."""
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["lr"]) for r in rows if "loss" in r]


@pytest.mark.parametrize("proof", PROOFS)
@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.name)
def test_equivalence(runs, feature, proof):
    single = runs.get(feature, "single")
    if proof == "resume":
        killed = runs.get(feature, "killed")
        assert logged(killed) == logged(single)
        a, b = h.checkpoint_tensors(single), h.checkpoint_tensors(killed)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{feature.name}: {k} differs after the resume"
        return
    other = runs.get(feature, proof)
    assert logged(other) == logged(single), f"{feature.name}: the logged lr differs under {proof}"
    assert checkpoint.latest(other).name == checkpoint.latest(single).name
    want = comparable(checkpoint.load_model_state(checkpoint.find(single))[0])
    got = comparable(checkpoint.load_model_state(checkpoint.find(other))[0])
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=feature.atol, msg=f"{feature.name}: {k} under {proof}")  # fmt: skip
