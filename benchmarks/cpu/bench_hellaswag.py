"""HellaSwag scorer throughput vs. plain forward passes of the same model and dtype.

    python benchmarks/cpu/bench_hellaswag.py --model bench                 # configs/bench.toml's model
    python benchmarks/cpu/bench_hellaswag.py --model gpt2 --limit 100      # GPT-2 124M, random weights

For each model: the scorer's time over the examples (all 10,042 by default) and its forward tokens/s
(real, non-padding tokens read by the model, per second), the padding share of its batches, and the
forward-only tokens/s of the same model on random (micro_batch_size, seq_len) batches of the same
number of tokens per forward (what `gptrain bench` feeds a training step, without the backward).
The target: scorer tokens/s >= 80% of forward-only tokens/s, padding <= 10%. With --limit the full
set's time is extrapolated from the subset's tokens/s and the full set's token count (printed as such).

On a shared machine the load changes while this runs, so the two are measured interleaved: the
examples are scored in chunks of --chunk examples, and before each chunk the forward-only batch
runs as many times as that chunk has batches; each side's tokens/s is its total over all chunks.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from gptrain.data.tokenizers import load_tokenizer
from gptrain.distributed.runtime import DistInfo
from gptrain.evals import hellaswag as hs
from gptrain.model.gpt import GPT, PRESETS, GPTConfig
from gptrain.training.precision import mixed_precision, resolve_dtype

REPO = Path(__file__).resolve().parents[2]
SHARED_HELLASWAG = REPO.parent / "shared" / "data" / "hellaswag" / "hellaswag_val.jsonl"
SHARED_GPT2 = REPO.parent / "shared" / "data" / "gpt2"


def model_for(name: str):
    """(model, tokenizer, seq_len, micro_batch_size) of the bench config or GPT-2 124M."""
    if name == "bench":
        from gptrain.config.load import load_config

        cfg = load_config(str(REPO / "configs" / "bench.toml"), [])
        tok = load_tokenizer(cfg.data.tokenizer)
        m, t = cfg.model, cfg.train
        arch = dict(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd)
        return GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=t.seq_len, **arch)), tok, t.seq_len, t.micro_batch_size  # fmt: skip
    if SHARED_GPT2.is_dir():
        os.environ.setdefault("GPTRAIN_GPT2_DIR", str(SHARED_GPT2))
    tok = load_tokenizer("gpt2")
    return GPT(GPTConfig(vocab_size=50257, block_size=1024, **PRESETS["gpt2"])), tok, 1024, 8


@torch.no_grad()
def forward_only(model, x, autocast, iters: int) -> float:
    """Seconds for `iters` forwards of the batch x."""
    with autocast:
        t0 = time.perf_counter()
        for _ in range(iters):
            model(x)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["bench", "gpt2"], default="bench")
    p.add_argument("--data", default=str(SHARED_HELLASWAG), help="hellaswag_val.jsonl or 'hellaswag'")  # fmt: skip
    p.add_argument("--limit", type=int, default=0, help="first N examples (0 = all 10,042)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk", type=int, default=50, help="examples per interleaved chunk")
    a = p.parse_args()
    torch.manual_seed(0)
    model, tok, seq_len, micro = model_for(a.model)
    model.eval()
    dtype = resolve_dtype(a.dtype, "cpu")
    autocast = mixed_precision(dtype, "cpu")[0] if dtype != torch.float32 else nullcontext()  # fmt: skip
    batch_tokens = seq_len * micro
    full = hs.HellaSwag(hs.load_examples(a.data), tok, model.config.block_size, batch_tokens)
    full_tokens = sum(len(s) - 1 for s in full.seqs)
    examples = full.examples[: a.limit] if a.limit else full.examples
    x = torch.randint(0, tok.vocab_size, (micro, seq_len))
    forward_only(model, x, autocast, 1)  # warm-up
    seconds = fwd_seconds = 0.0
    tokens = positions = truncated = fwd_batches = 0
    for i in range(0, len(examples), a.chunk):
        task = hs.HellaSwag(examples[i : i + a.chunk], tok, model.config.block_size, batch_tokens)
        fwd_seconds += forward_only(model, x, autocast, len(task.batches))
        fwd_batches += len(task.batches)
        t0 = time.perf_counter()
        result = task.score(model, DistInfo(), autocast)
        seconds += time.perf_counter() - t0
        tokens, positions = tokens + result.tokens, positions + result.positions
        truncated += result.truncated
    tps, fwd = tokens / seconds, fwd_batches * micro * seq_len / fwd_seconds
    n = len(examples)
    print(
        f"model {a.model} ({model.num_params() / 1e6:.1f}M non-embedding params), dtype {a.dtype}, "
        f"{torch.get_num_threads()} threads, {batch_tokens} tokens per forward"
    )
    print("| model | examples | tokens | time | scorer tok/s | forward-only tok/s | ratio | padding | truncated | full set (10,042) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    est = "measured" if n == len(full.examples) else "extrapolated"
    print(
        f"| {a.model} | {n:,} | {tokens:,} | {seconds:.1f} s | {tps:,.0f} | {fwd:,.0f} | {tps / fwd:.0%} | "
        f"{1 - tokens / positions:.2%} | {truncated:,} | {full_tokens / tps / 60:.1f} min ({est}, {full_tokens:,} tokens, padding {full.padding_share():.2%}) |"
    )


if __name__ == "__main__":
    main()
