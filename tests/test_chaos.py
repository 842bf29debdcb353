"""The chaos drill (benchmarks/drills/chaos.py), short: a 2-rank run with Muon (and AdamW for the rest),
DDP (full checkpoints) and FSDP2 (sharded ones), GPT-2's block (and nanochat's under FSDP2), 30 steps, a rank SIGKILLed inside an evaluation
(GPTRAIN_FAULT=kill_eval), failing to publish a checkpoint, a rank SIGKILLed while a checkpoint is
saved (kill_save: rank 0 under DDP; under FSDP2 this seed draws rank 1, dead once its shards are
written), then handed off to one process; every fault fires where it is aimed; the
weights, optimizer state (AdamW moments, Muon momentum) and data cursor equal an uninterrupted
2-rank run's bit for bit at the hand-off and within the cross-world-size tolerance at the end."""

import sys

import forked
import pytest
from train_helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "drills"))
import chaos  # noqa: E402


@pytest.mark.slow
@pytest.mark.benchmark
@pytest.mark.parametrize(
    ("mode", "arch"), [("ddp", "gpt2"), ("fsdp", "gpt2"), ("fsdp", "nanochat")]
)
def test_chaos_drill_kill_in_save_and_eval_failed_publish_other_world_size(
    byte_data, tmp_path, monkeypatch, mode, arch
):
    monkeypatch.setattr(chaos, "launch", forked.Popen)
    run = chaos.Run(byte_data, steps=30, mode=mode, optim="muon", arch=arch)
    lines = []
    ok = chaos.drill(run, 0, 1, tmp_path, echo=lines.append)
    assert ok, lines
    events = {line.split(": ")[1].split(" ")[0]: line for line in lines[:4]}
    assert sorted(events) == ["handoff", "kill_eval", "kill_save", "publish_error"], lines
    for line in events.values():
        assert "skipped" not in line and "ended first" not in line, lines
        assert "never fired" not in line, lines
        assert "exit 0," not in line, lines  # every one of them stopped the run
    assert "undisturbed on 1 process" in lines[4], lines
    assert " 0 momentum_buffer" not in lines[-1] and " 0 exp_avg," not in lines[-1], lines
