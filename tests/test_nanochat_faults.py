"""nanochat under faults, compiled, and from a pretrained folder: a 2-rank DDP run whose rank 1 is
SIGKILLed inside an evaluation (GPTRAIN_FAULT=kill_eval@4/1) resumes on ONE process and ends
where an uninterrupted one-process run ends (tests/test_distributed.py's tolerance across world
sizes); train.compile=true trains like eager; a model.arch naming the other block than the
model.init_from folder holds is one line, exit 2, nothing written, and an unset one becomes the
folder's."""

import json
import subprocess
import sys
import tomllib

import dist_helpers as h
import forked
import pytest
import torch
from train_helpers import DEBUG, assert_same_training, run, weights

from gptrain.__main__ import main as cli
from gptrain.checkpoint import manager as checkpoint
from gptrain.config.load import load_config, to_toml
from gptrain.distributed import faults
from gptrain.errors import UserError

NANOCHAT = ["model.arch=nanochat", "train.dtype=float32", "log.progress=false", "log.plot=false"]
RTOL, ATOL = 1e-5, 1e-6  # tests/test_distributed.py's tolerance across world sizes


@pytest.mark.slow
def test_rank_killed_in_an_eval_then_resumed_on_one_process_equals_one_process(byte_data, tmp_path):
    """kill_eval@4/1: rank 1 dies by SIGKILL inside step 4's evaluation, after step 4's
    checkpoint; the launcher ends the run; the same run on one process resumes from step 4 and
    its step-6 weights and last loss equal an uninterrupted one-process run's."""
    common = [*NANOCHAT, "train.max_steps=6", "train.micro_batch_size=4", "checkpoint.every=2"]
    common += ["eval.every=4", "eval.sample_every=0", "eval.tokens=512", "eval.sample_tokens=1"]
    common += ["optim.warmup_steps=1", "log.every=1", "dist.mode=ddp"]
    run(byte_data, tmp_path / "one", *common)  # uninterrupted, one process
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={run_dir}", *(f"--{o}" for o in common), "--dist.nproc_per_node=2"]
    env = {**h.env(), faults.ENV: "kill_eval@4/1"}
    proc = forked.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=h.TIMEOUT)
    assert proc.returncode != 0, err[-2000:]
    said = "gptrain: fault injection (GPTRAIN_FAULT): kill_eval at step 4: killed inside the evaluation: SIGKILL"  # fmt: skip
    assert said in err, err[-2000:]
    assert checkpoint.latest(run_dir).name == "step_00000004"
    summary = run(byte_data, run_dir, *common, "dist.nproc_per_node=1")
    assert summary["steps"] == 6 and summary["world_size"] == 1
    log = (run_dir / "train.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000004'}" in log
    assert "world size 2" in log  # the killed attempt trained on two ranks
    want, got = weights(tmp_path / "one"), weights(run_dir)
    assert want.keys() == got.keys() and "lm_head.weight" in want  # nanochat's untied head
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=k)
    loss = [_last_loss(d) for d in (tmp_path / "one", run_dir)]
    assert loss[1] == pytest.approx(loss[0], rel=RTOL)


def _last_loss(run_dir) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r][-1]


@pytest.mark.slow
def test_compiled_nanochat_run_equals_eager(byte_data, tmp_path):
    """train.compile=true on the nanochat block: 3 steps, the same weights as eager (up to the
    kernels' summation order, as tests/test_train.py's GPT-2 case) and the same final val loss,
    plain keys in the checkpoint."""
    common = [*NANOCHAT, "train.max_steps=3", "optim.warmup_steps=1", "eval.every=0"]
    common += ["eval.tokens=512", "train.micro_batch_size=4", "eval.sample_every=0"]
    common += ["eval.sample_tokens=4", "checkpoint.every=0"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the GPT-2 case: inductor's code names its thread count
    try:
        eager = run(byte_data, tmp_path / "eager", *common)
        compiled = run(byte_data, tmp_path / "compiled", "train.compile=true", *common)
    finally:
        torch.set_num_threads(threads)
    a, b = weights(tmp_path / "eager"), weights(tmp_path / "compiled")
    assert a.keys() == b.keys() and not any("_orig_mod" in k for k in b)
    assert_same_training(b, a, "compiled vs eager (nanochat)", 3 * 3e-3, rtol=1e-4, atol=1e-5)
    # the final evaluation ran the compiled inference graph (no autograd): the same val loss
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-5)


def _folder(tmp_path, model_type: str | None):
    """A model.init_from folder as config loading reads it (its config.json alone)."""
    folder = tmp_path / f"init-{model_type}"
    folder.mkdir()
    raw = {"model_type": model_type} if model_type else {}  # absent: GPT-2, as load_hf_folder
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize(
    "model_type, arch, name",
    [("nanochat", "gpt2", "NanoChat"), ("gpt2", "nanochat", "GPT-2"), (None, "nanochat", "GPT-2")],
)
def test_init_from_with_the_other_arch_is_one_line_exit_2(tmp_path, capsys, model_type, arch, name):
    """An explicit model.arch (command line or file) naming the other block than the folder's
    config.json model_type: one line naming the key, the folder and its model_type, exit 2, no
    run folder; the same folder without model.arch loads as its own block."""
    folder, run_dir = _folder(tmp_path, model_type), tmp_path / "run"
    found = model_type or "gpt2"
    needle = f"model.arch = {arch!r} but model.init_from = {str(folder)!r} holds a {name} model (config.json model_type {found!r}); drop model.arch (the folder sets it) or set --model.arch={found}"  # fmt: skip
    assert cli(["train", f"--run.dir={run_dir}", f"--model.init_from={folder}", f"--model.arch={arch}"]) == 2  # fmt: skip
    assert capsys.readouterr().err.strip() == f"gptrain: error: {needle}"
    file = tmp_path / "c.toml"
    file.write_text(f"[model]\narch = {arch!r}\ninit_from = {str(folder)!r}\n")
    assert cli(["train", "--config", str(file), f"--run.dir={run_dir}"]) == 2
    assert capsys.readouterr().err.strip() == f"gptrain: error: {needle}"
    assert not run_dir.exists()
    cfg = load_config(None, [f"model.init_from={folder}"])  # unset: the folder's block
    assert cfg.model.arch == found
    again = tmp_path / "resolved.toml"  # the resolved config (run.dir/config.toml) loads back
    again.write_text(to_toml(cfg))
    assert tomllib.loads(again.read_text())["model"]["arch"] == found
    assert load_config(str(again)) == cfg
    assert load_config(None, [f"model.init_from={folder}", f"model.arch={found}"]) == cfg


def test_the_build_refuses_a_folder_of_the_other_arch(tmp_path):
    """Where the folder is read (training/build.py): a config whose model.arch is not the weights'
    block (the folder changed after the config was loaded) is the same one-line refusal."""
    from dataclasses import replace

    import transformers

    from gptrain.training.build import build_model

    folder = tmp_path / "hf"
    hf = transformers.NanoChatConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.NanoChatForCausalLM(hf).save_pretrained(folder)
    cfg = load_config(DEBUG, [f"model.init_from={folder}"])
    assert cfg.model.arch == "nanochat" and build_model(cfg, 257).arch == "nanochat"
    wrong = replace(cfg, model=replace(cfg.model, arch="gpt2"))
    with pytest.raises(UserError, match="model.arch = 'gpt2' but model.init_from = .* holds a NanoChat model") as e:  # fmt: skip
        build_model(wrong, 257)
    assert "\n" not in str(e.value)
