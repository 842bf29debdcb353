"""True metrics: measured device peak for MFU, and the loggers (main process only).

MFU = achieved model FLOP/s / peak FLOP/s, where the peak is MEASURED in the same run on this
device with a large matmul in the training dtype, never looked up by GPU name.

Loggers share one tiny interface: `log(step, metrics: dict)`, `text(line)`, `close()`. The main
process gets the real ones (console text log, metrics.jsonl, TensorBoard, W&B); other ranks a no-op.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

from gptrain.errors import UserError


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# (M, K, N) shapes timed for the peak: a large square matmul and the tall, thin shapes of a
# transformer's projections (tokens x width); some devices are fastest on the latter.
PEAK_SHAPES = {
    "cuda": [(8192, 8192, 8192), (16384, 4096, 4096), (16384, 1024, 4096)],
    "cpu": [(2048, 2048, 2048), (4096, 1024, 1024), (4096, 256, 1024)],
}


def measure_peak_flops(device: str, dtype: torch.dtype, seconds_per_shape: float = 0.25) -> float:
    """Peak FLOP/s of this device in `dtype`: the fastest of several large matmuls (each the
    best of repeated timed runs). MFU divides by this measured number, never a datasheet's."""
    gen = torch.Generator(device=device).manual_seed(0)  # never touch the global RNG (exact resume)
    peak = 0.0
    for m, k, n in PEAK_SHAPES["cuda" if device.startswith("cuda") else "cpu"]:
        a = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
        b = torch.randn(k, n, device=device, dtype=dtype, generator=gen)
        for _ in range(2):  # warm-up (kernel selection, allocator, AMX tile config)
            a @ b
        synchronize(device)
        best, spent = math.inf, 0.0
        while spent < seconds_per_shape or best == math.inf:
            t0 = time.perf_counter()
            a @ b
            synchronize(device)
            dt = time.perf_counter() - t0
            best, spent = min(best, dt), spent + dt
        peak = max(peak, 2 * m * k * n / best)
    return peak


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    return tokens_per_s * flops_per_token / peak_flops


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def require_packages(tensorboard: bool, wandb_project: str) -> None:
    """The optional logging packages a config asks for are installed (checked on every rank at
    start-up, so a missing one is a one-line error everywhere, not a hang of the other ranks)."""
    import importlib.util

    for wanted, module, key in ((tensorboard, "tensorboard", "log.tensorboard = true"), (wandb_project, "wandb", f"log.wandb = {wandb_project!r}")):  # fmt: skip
        if wanted and not _importable(module, importlib.util):
            raise UserError(f"{key} needs the {module} package: pip install {module}")


def _importable(module: str, util) -> bool:
    try:
        return util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


def rewind_metrics(run_dir: str | Path, step: int) -> int:
    """Drop metrics.jsonl rows logged after `step` (a run that crashed after its last checkpoint
    redoes those steps when it resumes); the file is replaced atomically. Returns rows dropped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by the crash
            continue
        if row.get("step", 0) <= step:
            kept.append(line)
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


class NullLogger:
    """What non-main ranks get: every call does nothing."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def text(self, line: str, echo: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


class RunLogger(NullLogger):
    """Main process: metrics.jsonl + train.log in the run directory, optional TensorBoard / W&B.

    `echo` is called with every text line (the progress bar's `write`, or print).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = False,
        wandb_project: str = "",
        config: dict | None = None,
        echo=print,
    ):
        require_packages(tensorboard, wandb_project)
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.tb = self.wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tb"))
        if wandb_project:
            import wandb

            self.wandb = wandb.init(project=wandb_project, dir=str(self.dir), config=config)
        self.jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self.textlog = open(self.dir / "train.log", "a", buffering=1)

    def log(self, step: int, metrics: dict) -> None:
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        for key, value in metrics.items():
            if self.tb is not None and isinstance(value, (int, float)):
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def text(self, line: str, echo: bool = True) -> None:
        self.textlog.write(line + "\n")
        if echo:
            self.echo(line)

    def close(self) -> None:
        self.jsonl.close()
        self.textlog.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
