"""The speed choices' line in the run's log (training/choices.py, Choices.line)."""

from __future__ import annotations

from gptrain.training import float8 as fp8


def line(c) -> str:
    """One line for the run's log: each choice of the Choices `c`, how it was made and the
    timings behind it."""

    def ms(times: dict) -> str:
        return ", ".join(f"{k} {v:.3g} ms" for k, v in times.items())

    parts = [f"train.dtype={c.dtype} ({c.how['dtype']})"]
    parts.append(f"train.attention={c.attention} ({c.how['attention']})")
    if c.block_ms:
        n, t = c.block_tokens
        parts[-1] += f" [one block fwd+bwd of {n}x{t} tokens: {ms(c.block_ms)}]"
    if c.loss:
        parts.append(f"train.loss={c.loss} ({c.how['loss']})")
        if c.loss_ms:
            parts[-1] += f" [the head's loss fwd+bwd of {c.loss_rows} rows: {ms(c.loss_ms)}]"
    parts += fp8.line_part(c)
    if c.muon_dtype:
        parts.append(f"optim.muon_dtype={c.muon_dtype} ({c.how['muon_dtype']})")
        if c.muon_ms:
            parts[-1] += f" [orthogonalising one matrix of each shape: {ms(c.muon_ms)}]"
    if c.muon_split:
        parts.append(f"optim.muon_split={c.muon_split} ({c.how['muon_split']})")
        if c.split_ms:
            times = ms(c.split_ms)
            parts[-1] += f" [a Muon step's orthogonalisations, slowest rank: {times}]"
    if c.bf16_ratio is not None:
        parts.append(f"bf16 matmul {c.bf16_ratio:.2g}x float32's time")
    return f"speed choices in {c.seconds:.2f} s: " + ", ".join(parts)
