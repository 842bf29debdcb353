"""What the trainer tests share: the debug config, a one-process run of it, a checkpoint's
weights, and the comparisons of two runs' weights (bit for bit, or up to summation order)."""

from pathlib import Path

import torch

from gptrain.checkpoint import manager as checkpoint
from gptrain.commands.train import train
from gptrain.config.load import load_config
from gptrain.distributed.runtime import DistInfo

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")


def run(byte_data, run_dir, *overrides):
    """A one-process run of configs/debug.toml in this process, with a short final evaluation
    and sample (512 tokens, 1 token; a test's overrides come after and win) and no plot."""
    base = [f"data.dir={byte_data}", f"run.dir={run_dir}", "log.progress=false", "log.plot=false"]
    base += ["eval.tokens=512", "eval.sample_tokens=1"]
    cfg = load_config(DEBUG, [*base, *overrides])
    return train(cfg, DistInfo())


def weights(run_dir, step=None):
    return checkpoint.load_model_state(checkpoint.find(run_dir, step))[0]


def comparable(state: dict, n_embd: int = 64) -> dict:
    """Weights minus the key part of each attention input bias: its true gradient is exactly zero
    (a constant added to every score of a query leaves the softmax unchanged), so AdamW turns the
    ~1e-11 rounding noise in it into full +-lr steps whose sign depends on the summation order."""
    out = dict(state)
    for k, v in state.items():
        if k.endswith("attn.c_attn.bias"):
            out[k] = torch.cat([v[:n_embd], v[2 * n_embd :]])
    return out


def assert_same_training(got: dict, want: dict, what: str, lr_sum: float, rtol=1e-5, atol=1e-6):
    """Weights of two runs that did the same computation in another summation order (micro-batch
    shapes or compiled kernels pick other float32 kernels, which differ by CPU): every element
    within rtol/atol, except at most 0.1% of a tensor's elements (at least one). Those are
    entries whose gradient is ~0: AdamW's normalised step m / sqrt(v) turns their rounding noise
    into steps of up to lr with an arbitrary sign. Even they stay below lr_sum (the learning
    rates of all steps added up). A wrong batch, scaling or graph moves most elements."""
    for k, v in want.items():
        diff = (got[k] - v).abs()
        outliers = int((diff > atol + rtol * v.abs()).sum())
        assert outliers <= max(1, v.numel() // 1000), f"{k} differs in {outliers} of {v.numel()} elements, {what}"  # fmt: skip
        assert diff.max() < lr_sum, f"{k} differs by {diff.max():.3g} >= {lr_sum}, {what}"
