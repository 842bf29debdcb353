"""Loggers: metrics.jsonl, train.log, TensorBoard and W&B receive the same numbers, on a fresh run
and after a resume that redoes logged steps; a logger that cannot start is a one-line error."""

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest

from gptrain.errors import UserError
from gptrain.logs.loggers import (
    WANDB_ID_FILE,
    WANDB_STEP,
    NullLogger,
    RunLogger,
    rewind_metrics,
    tracker_key,
)

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")


def jsonl(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def tensorboard_scalars(log_dir) -> dict[str, dict[int, float]]:
    """What TensorBoard shows: {tag: {step: value}} (it hides purged and superseded events)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_points(log_dir, tag: str) -> list[tuple[int, float]]:
    """Every (step, value) TensorBoard plots for `tag`, in order (a step may appear twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def grouped(row: dict) -> dict:
    """A metrics.jsonl row with the grouped names TensorBoard and W&B use (`step` kept)."""
    return {k if k == "step" else tracker_key(k): v for k, v in row.items()}


def wandb_history(run_dir, summary: dict | None = None) -> list[list[dict]]:
    """The history rows of each W&B offline run under run_dir/wandb, oldest first (and the
    run summary's items collected into `summary` when given).

    The .wandb file is a LevelDB-style log (a 7-byte ':W&B' header, then records in 32 KiB blocks,
    each chunk with a 7-byte header: crc32c, length, type) of wandb's protobuf Records.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunk, rows = path.read_bytes(), 7, b"", []
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if left < 7 or (kind == 0 and length == 0):  # block trailer / padding
                pos += left
                continue
            chunk += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a full record, or the last piece of one
                record = pb.Record()
                record.ParseFromString(chunk)
                chunk = b""
                if record.WhichOneof("record_type") == "history":
                    items = {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in record.history.item
                    }
                    step = items.pop(WANDB_STEP, items["_step"])  # the chart's x-axis
                    rows.append({k: v for k, v in items.items() if k[0] != "_"} | {"step": step})
                elif record.WhichOneof("record_type") == "summary" and summary is not None:
                    for i in record.summary.update:
                        summary[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
        runs.append((path.parent.name, rows))
    return [rows for _name, rows in runs]


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    """W&B logging locally, never touching the user's login, settings or cache."""
    pytest.importorskip("wandb", reason="wandb not installed (pip install -e '.[dev]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


def test_run_logger_writes_jsonl_and_text(tmp_path):
    echoed = []
    logger = RunLogger(tmp_path)
    logger.echo = echoed.append
    logger.log(10, {"loss": 2.5, "lr": 1e-3})
    logger.text("hello")
    logger.text("quiet", echo=False)
    logger.close()
    assert jsonl(tmp_path) == [{"step": 10, "loss": 2.5, "lr": 1e-3}]
    assert (tmp_path / "train.log").read_text() == "hello\nquiet\n"
    assert echoed == ["hello"]
    NullLogger().log(1, {"loss": 1.0})  # the non-main ranks' logger accepts the same calls


def test_rewind_drops_rows_after_the_checkpoint_and_a_torn_last_line(tmp_path):
    rows = [{"step": s, "loss": 1.0 / s} for s in (2, 4, 6)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    assert rewind_metrics(tmp_path, 4) == 2
    assert jsonl(tmp_path) == rows[:2]
    assert rewind_metrics(tmp_path, 4) == 0


def test_run_that_crashed_before_its_first_checkpoint_starts_its_logs_over(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed")
    for attempt in (1, 2):  # attempt 1 dies after logging two steps (no checkpoint to resume)
        logger = RunLogger(tmp_path, tensorboard=True, resume_step=None)
        for step in (0, 2):
            logger.log(step, {"loss": 10.0 * attempt + step})
        logger.close()
    assert jsonl(tmp_path) == [{"step": 0, "loss": 20.0}, {"step": 2, "loss": 22.0}]
    assert tensorboard_scalars(tmp_path / "tb") == {"train/loss": {0: 20.0, 2: 22.0}}


def test_tensorboard_and_wandb_get_what_metrics_jsonl_gets(tmp_path, offline_wandb):
    pytest.importorskip("tensorboard", reason="tensorboard not installed")
    logger = RunLogger(tmp_path, tensorboard=True, wandb_project="gptrain-test", config={"a": 1})
    for step in (0, 5, 10):
        logger.log(step, {"loss": 3.0 - step / 10, "lr": 1e-3 * step, "tokens": 64 * step})
    logger.log(10, {"val_loss": 2.5})  # a second row for one step (eval): TB and W&B keep it
    logger.close()
    rows = jsonl(tmp_path)
    tb = tensorboard_scalars(tmp_path / "tb")
    for key in ("loss", "lr", "tokens"):
        assert tb[f"train/{key}"] == pytest.approx({r["step"]: r[key] for r in rows if key in r})
    assert tb["val/loss"] == {10: 2.5}
    deadline = (
        time.monotonic() + 60
    )  # wandb's writer process may still be flushing on a busy machine
    while len(history := wandb_history(tmp_path)[0]) < 4 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert history == [grouped(r) for r in rows]  # under W&B's x-axis, trainer/step
    assert (tmp_path / WANDB_ID_FILE).read_text().strip()


def test_resumed_run_shows_each_step_once_in_every_logger(byte_data, tmp_path, offline_wandb):
    """A run resumed from step 4 after logging steps 6 and 8 redoes them with another learning
    rate: TensorBoard and metrics.jsonl show the redone values, and W&B continues the same run."""
    pytest.importorskip("tensorboard", reason="tensorboard not installed")
    run_dir = tmp_path / "run"
    common = [f"--data.dir={byte_data}", f"--run.dir={run_dir}", "--log.progress=false", "--log.plot=false"]  # fmt: skip
    common += ["--train.max_steps=8", "--checkpoint.every=4", "--log.every=2", "--eval.every=4"]
    common += ["--eval.sample_every=0", "--log.tensorboard=true", "--log.wandb=gptrain-test"]

    def train(*extra):  # a process per run, as a user's restart is (W&B keeps state per process)
        cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, *common, *extra]
        proc = forked.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]

    train()
    first = jsonl(run_dir)
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    train("--checkpoint.resume=4", "--optim.lr=1e-2")
    final = jsonl(run_dir)

    assert [r["step"] for r in final] == [r["step"] for r in first] == [0, 2, 4, 6, 8]
    assert final[:3] == first[:3]  # up to the checkpoint: kept as logged
    assert final[3]["loss"] != first[3]["loss"]  # redone with another lr
    tb = tensorboard_scalars(run_dir / "tb")
    for key in ("loss", "lr", "val_loss"):
        assert tb[tracker_key(key)] == pytest.approx({r["step"]: r[key] for r in final if key in r})
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == run_id
    assert all(run_id in p.name for p in run_dir.glob("wandb/offline-run-*"))
    before, after = wandb_history(run_dir)
    assert before == [grouped(r) for r in first]
    assert after == [
        grouped(r) for r in final[3:]
    ]  # the resumed process sent the redone steps under the same run id


def test_a_rollback_leaves_only_the_redone_values_in_every_tracker(tmp_path, offline_wandb):
    """A mid-run rollback (rewind to step 3 after logging 1..6, a spike at 6) redoes steps 4..6:
    metrics.jsonl and TensorBoard hold exactly the redone values, and W&B's last row for each of
    those steps (its x-axis, trainer/step) is the redone one."""
    pytest.importorskip("tensorboard", reason="tensorboard not installed")
    logger = RunLogger(tmp_path, tensorboard=True, wandb_project="gptrain-test")
    first = {step: 10.0 - step for step in range(1, 7)} | {6: 99.0}  # step 6: the spike
    redone = {step: 5.0 - step / 10 for step in (4, 5, 6)}
    for step, loss in first.items():
        logger.log(step, {"loss": loss})
    logger.rewind(3)
    for step, loss in redone.items():
        logger.log(step, {"loss": loss})
    logger.close()
    wanted = {s: first[s] for s in (1, 2, 3)} | redone
    assert {r["step"]: r["loss"] for r in jsonl(tmp_path)} == wanted
    points = tensorboard_points(tmp_path / "tb", "train/loss")  # the spike and 4, 5 hidden
    assert [s for s, _ in points] == list(wanted)
    assert [v for _, v in points] == pytest.approx(list(wanted.values()))
    deadline = time.monotonic() + 60  # wandb's writer process may still be flushing
    while len(history := wandb_history(tmp_path)[0]) < 9 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
    last = {r["step"]: r["train/loss"] for r in history}  # later rows win
    assert last == pytest.approx(wanted)


def test_wandb_that_cannot_start_is_one_line_exit_2(byte_data, tmp_path):
    """Not logged in (a fresh process: wandb keeps its settings per process)."""
    pytest.importorskip("wandb", reason="wandb not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    # no credentials: no .netrc (NETRC names one that does not exist), no settings folder
    env |= {"NETRC": str(tmp_path / "netrc"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    run_dir = tmp_path / "run"
    args = ["--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    args.append("--log.wandb=proj")
    proc = forked.run(
        [sys.executable, "-m", "gptrain", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "log.wandb = 'proj': W&B did not start" in lines[0] and "wandb login" in lines[0]
    assert not (run_dir / "metrics.jsonl").exists()


def test_missing_logging_packages_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(UserError, match="pip install wandb"):
        RunLogger(tmp_path, wandb_project="proj")
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before writing anything


def test_tracker_keys_are_grouped():
    keys = ("loss", "tok_per_s", "val_loss", "val_bpb", "hellaswag_acc_norm")
    grouped_keys = ["train/loss", "train/tok_per_s", "val/loss", "val/bpb", "hellaswag/acc_norm"]
    assert [tracker_key(k) for k in keys] == grouped_keys


def tensorboard_hparams(log_dir) -> dict:
    """The hparams TensorBoard shows for the run (its session-start plugin record)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    data = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    return {k: v.number_value for k, v in data.session_start_info.hparams.items()}


def test_scorecard_reaches_tensorboard_hparams_and_wandb_summary(tmp_path, offline_wandb):
    pytest.importorskip("tensorboard", reason="tensorboard not installed")
    logger = RunLogger(tmp_path, tensorboard=True, wandb_project="gptrain-test")
    logger.log(1, {"loss": 2.0})
    hparams = {"peak_lr": 6e-4, "steps": 10, "n_layer": 2, "epochs": 0.5}
    results = {"best_val_loss": 1.5, "final_val_bpb": 2.25, "hellaswag_acc_norm": 0.25}
    logger.scorecard(hparams, results)
    logger.close()
    assert tensorboard_hparams(tmp_path / "tb") == pytest.approx(hparams)
    tb = tensorboard_scalars(tmp_path / "tb")
    assert {k: v for k, v in tb.items() if k.startswith("scorecard/")} == {
        f"scorecard/{k}": {0: pytest.approx(v)} for k, v in results.items()
    }
    wanted = [f"scorecard/{k}" for k in results] + [f"hparams/{k}" for k in hparams]
    deadline = time.monotonic() + 60  # wandb's writer process may still be flushing (busy machine)
    while True:
        summary: dict = {}
        wandb_history(tmp_path, summary)
        if all(k in summary for k in wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for k, v in results.items():
        assert summary[f"scorecard/{k}"] == pytest.approx(v)
    for k, v in hparams.items():
        assert summary[f"hparams/{k}"] == pytest.approx(v)


def test_best_val_counts_the_eval_logged_after_its_checkpoint(tmp_path):
    """A step's checkpoint is written before its eval, so on resume the best val loss is the
    lower of the checkpoint's record and metrics.jsonl's kept rows (a cut-short line is skipped)."""
    from gptrain.logs.loggers import best_val

    rows = [{"step": 0, "val_loss": 5.0}, {"step": 3, "loss": 4.0}, {"step": 4, "val_loss": 3.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"ste')
    saved = {"best_val_loss": 4.0, "best_val_step": 2}
    assert best_val(tmp_path, saved) == {"best_val_loss": 3.5, "best_val_step": 4}
    assert best_val(tmp_path, {"best_val_loss": 3.0, "best_val_step": 1})["best_val_step"] == 1
    assert best_val(tmp_path / "none", saved) == saved
