"""benchmarks/gpu/gpu_blocks.py, GPT-2's block against nanochat's on a GPU, checked on a CPU: its dry
run benches both presets and trains each for the same steps on the same tokens, and its tables
hold what each run wrote; nanoGPT's iteration times are read as nanoGPT prints them; bad input is
one line, exit code 2."""

import json
import sys
import tomllib

import forked
import pytest
from train_helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
import gpu_blocks  # noqa: E402

STEPS = 4


def rows(text: str) -> list[list[str]]:
    lines = [x for x in text.splitlines() if x.startswith("| ") and not x.startswith("| block")]
    return [[c.strip() for c in x.strip("|").split("|")] for x in lines]


@pytest.mark.benchmark
def test_the_dry_run_benches_and_races_both_blocks_on_the_same_tokens(
    byte_data, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(gpu_blocks.gpu_recipe, "run_command", forked.run)
    out = tmp_path / "blocks"
    argv = ["--dry-run", "--out", str(out), "--data", str(byte_data), "--steps", str(STEPS)]
    assert gpu_blocks.main(argv) == 0
    table = rows(capsys.readouterr().out)
    result = json.loads((out / "blocks.json").read_text())
    for name, arch in (("gpt2", "gpt2"), ("nanochat", "nanochat")):
        bench = json.loads((out / f"bench_{name}.json").read_text())[0]
        benched = [r for r in table if r[0] == name and len(r) == 5][-1]
        assert benched[1:3] == [f"{bench['tok_per_s']:,.0f}", f"{bench['mfu']:.1%}"]
        config = tomllib.loads((out / f"race_{name}" / "config.toml").read_text())
        summary = json.loads((out / f"race_{name}" / "summary.json").read_text())
        assert config["model"]["arch"] == arch and config["train"]["max_steps"] == STEPS
        raced = [r for r in table if r[0] == name and len(r) == 6][-1]
        assert raced[1:3] == [f"{STEPS:,}", f"{summary['tokens']:,}"]
        assert raced[5] == f"{summary['val_loss']:.4f}"
    tokens = {r["tokens"] for r in result["race"]}
    assert len(tokens) == 1 and len(result["race"]) == 2  # the same tokens for both blocks
    done = {p: p.read_text() for p in [*out.glob("race_*/attempts.jsonl"), *out.glob("bench_*")]}
    monkeypatch.setattr(gpu_blocks.gpu_recipe, "run_command", None)  # nothing may start
    assert gpu_blocks.main(argv) == 0
    assert {p: p.read_text() for p in done} == done


def test_nanogpt_speed_is_read_from_its_own_iteration_lines(tmp_path, monkeypatch):
    """A stand-in for nanoGPT's train.py prints iteration lines in its format: tok/s is the
    tokens of one iteration over the mean time of the later half of them."""
    times = [900.0, 500.0, 40.0, 60.0, 50.0, 50.0]  # compilation first, then steady
    lines = [f"print('iter {i}: loss 4.2, time {t}ms, mfu 1.00%')" for i, t in enumerate(times)]
    (tmp_path / "train.py").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(gpu_blocks.gpu_recipe, "run_command", forked.run)
    got = gpu_blocks.nanogpt(tmp_path, tmp_path, dry=True)
    assert got["iterations_timed"] == 3 and abs(got["step_ms"] - 160 / 3) < 1e-9
    assert abs(got["tok_per_s"] - 4 * 64 * 2 / (160 / 3 / 1e3)) < 1e-6
    assert gpu_blocks.nanogpt(tmp_path / "gone", tmp_path, dry=True) == got  # read back, not run


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "blocks"
    assert gpu_blocks.main(["--dry-run", "--nanogpt", str(tmp_path), "--out", str(out)]) == 2
    assert capsys.readouterr().out.strip().splitlines() == [
        f"gpu_blocks: --nanogpt {tmp_path}: no train.py there; give a nanoGPT checkout"
    ]
    assert not out.exists()
