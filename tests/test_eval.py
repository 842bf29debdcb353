"""HellaSwag in the training loop and `gptrain eval`: the loop's numbers equal what `gptrain eval`
computes on the saved checkpoint, a run and its Hugging Face export score the same, the best val
loss survives a resume, and the trackers get grouped curves and the scorecard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SHARED
from test_logs import tensorboard_hparams, tensorboard_scalars

from gptrain.__main__ import main as cli
from gptrain.checkpoint import manager as checkpoint
from gptrain.commands.train import train
from gptrain.config.load import load_config
from gptrain.distributed.runtime import DistInfo

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")
HELLASWAG = SHARED / "hellaswag" / "hellaswag_val.jsonl"


@pytest.fixture(scope="module")
def hellaswag_file():
    if not HELLASWAG.is_file():
        pytest.skip(f"HellaSwag test data not found at {HELLASWAG}")
    return HELLASWAG


def run(byte_data, run_dir, *overrides):
    base = [f"data.dir={byte_data}", f"run.dir={run_dir}", "log.progress=false", "log.plot=false", "eval.sample_every=0"]  # fmt: skip
    return train(load_config(DEBUG, [*base, *overrides]), DistInfo())


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def eval_json(capsys, tmp_path, *args) -> dict:
    out = tmp_path / f"eval-{len(list(tmp_path.glob('eval-*')))}.json"
    assert cli(["eval", *args, "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    return json.loads(out.read_text())


@pytest.mark.slow
def test_loop_hellaswag_equals_gptrain_eval_and_the_hf_export(byte_data, hellaswag_file, tmp_path, capsys):  # fmt: skip
    pytest.importorskip("tensorboard", reason="tensorboard not installed")
    run_dir = tmp_path / "run"
    hs = [f"eval.hellaswag={hellaswag_file}", "eval.hellaswag_every=4", "eval.hellaswag_limit=24"]
    summary = run(byte_data, run_dir, "train.max_steps=6", "eval.every=3", "log.every=3", "checkpoint.every=3", "log.tensorboard=true", "log.plot=true", *hs)  # fmt: skip
    logged = rows(run_dir)
    scored = [r["step"] for r in logged if "hellaswag_acc_norm" in r]
    assert scored == [0, 4, 6]  # the baseline, every 4 steps, the end
    final = [r for r in logged if r["step"] == 6 and "val_loss" in r][-1]

    # the same checkpoint through `gptrain eval`: the same HellaSwag and val numbers
    common = ["--tasks", "val,hellaswag", "--hellaswag", str(hellaswag_file), "--hellaswag-limit", "24", "--val-tokens", "8192"]  # fmt: skip
    ours = eval_json(capsys, tmp_path, "--run", str(run_dir), *common)
    assert ours["step"] == 6 and ours["hellaswag_examples"] == 24
    assert ours["hellaswag_truncated"] > 0  # 64-token context: contexts cut on the left, counted
    assert ours["hellaswag_acc"] == final["hellaswag_acc"]
    assert ours["hellaswag_acc_norm"] == final["hellaswag_acc_norm"]
    assert ours["val_loss"] == pytest.approx(final["val_loss"], rel=1e-5)
    assert ours["val_bpb"] == pytest.approx(final["val_bpb"], rel=1e-5)

    # its Hugging Face export scores the same (val on the run's data folder)
    assert cli(["export", "--run", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    hf = eval_json(capsys, tmp_path, "--hf", str(tmp_path / "hf"), "--data", str(byte_data), *common)  # fmt: skip
    for key in ("hellaswag_acc", "hellaswag_acc_norm", "val_loss", "val_bpb"):
        assert hf[key] == pytest.approx(ours[key], rel=1e-5), key

    # scorecard: best val loss in summary and meta.json; grouped curves and hparams in TensorBoard
    vals = [(r["val_loss"], r["step"]) for r in logged if "val_loss" in r]
    assert (summary["best_val_loss"], summary["best_val_step"]) == min(vals)
    # a checkpoint is written before its own step's eval: its meta.json holds the best
    # of the evals before it; resume adds that step's eval back from metrics.jsonl
    meta = checkpoint.load_meta(checkpoint.find(run_dir, 6))
    assert (meta["best_val_loss"], meta["best_val_step"]) == min(v for v in vals if v[1] < 6)
    tb = tensorboard_scalars(run_dir / "tb")
    assert tb["hellaswag/acc_norm"] == pytest.approx({r["step"]: r["hellaswag_acc_norm"] for r in logged if "hellaswag_acc_norm" in r})  # fmt: skip
    assert "val/loss" in tb and "train/loss" in tb and "loss" not in tb
    assert tb["scorecard/best_val_loss"] == {0: pytest.approx(summary["best_val_loss"])}
    assert tb["scorecard/hellaswag_acc_norm"] == {0: pytest.approx(final["hellaswag_acc_norm"])}
    hp = tensorboard_hparams(run_dir / "tb")
    assert hp["steps"] == 6 and hp["n_layer"] == 2 and hp["total_tokens"] == 6 * 1024
    assert hp["epochs"] == pytest.approx(6 * 1024 / sum(e["tokens"] for e in json.loads((byte_data / "manifest.json").read_text())["shards"] if e["split"] == "train"))  # fmt: skip
    assert (run_dir / "loss.png").is_file()


@pytest.mark.slow
def test_best_val_loss_survives_a_resume(byte_data, tmp_path):
    """Steps 1-4 train normally; the resumed steps 5-8 use a learning rate that ruins the model,
    so the best val loss is one from before the resume, known only through the checkpoint."""
    run_dir = tmp_path / "run"
    common = ["eval.every=2", "checkpoint.every=4", "log.every=2", "optim.warmup_steps=1"]
    run(byte_data, run_dir, "train.max_steps=4", *common)
    summary = run(byte_data, run_dir, "train.max_steps=8", "optim.lr=3.0", "optim.min_lr=3.0", *common)  # fmt: skip
    vals = [(r["val_loss"], r["step"]) for r in rows(run_dir) if "val_loss" in r]
    best = min(vals)
    assert best[1] <= 4 and (summary["best_val_loss"], summary["best_val_step"]) == best
    assert json.loads((run_dir / "summary.json").read_text())["best_val_loss"] == best[0]
    assert checkpoint.load_meta(checkpoint.find(run_dir, 8))["best_val_step"] == best[1]


def test_eval_needs_data_for_val_of_an_hf_folder(tmp_path, capsys):
    from test_hellaswag import save_run

    from gptrain.data.tokenizers import load_tokenizer

    save_run(tmp_path / "run", load_tokenizer("byte"), 64)
    assert cli(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert cli(["eval", "--hf", str(tmp_path / "hf"), "--tasks", "val"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tasks val needs --data DIR" in err
