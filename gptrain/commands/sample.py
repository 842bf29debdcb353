"""Generate text from a trained run: `gptrain sample --run DIR --prompt TEXT`.

    gptrain sample --run runs/debug --prompt "ROMEO:" --num-samples 3
    gptrain sample --run runs/debug --prompt "" --temperature 0      # greedy, from end-of-text

`generate_text` is also what the trainer calls for in-training samples; it accepts the model as
the trainer holds it (plain, compiled in place, DDP, or FSDP2 on every rank in lockstep).
"""

from __future__ import annotations

import torch

from gptrain.errors import ArgParser, UserError
from gptrain.evals.generate import generate_text, load_model


def _pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, but no CUDA device is available; use --device cpu")
    return name


def main(argv: list[str]) -> int:
    p = ArgParser(prog="gptrain sample", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="run directory (holds checkpoints/)")
    p.add_argument("--prompt", default="", help="text to continue; empty starts from end-of-text")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    a = p.parse_args(argv)
    if a.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {a.temperature}")
    if a.top_k < 1:
        raise UserError(f"--top-k must be >= 1, got {a.top_k}")
    if a.num_samples < 1:
        raise UserError(f"--num-samples must be >= 1, got {a.num_samples}")
    if a.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {a.max_new_tokens}")
    device = _pick_device(a.device)
    model, tokenizer, meta = load_model(a.run, a.step, device)
    texts = generate_text(
        model,
        tokenizer,
        a.prompt,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        num_samples=a.num_samples,
        seed=a.seed,
        device=device,
    )
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1}/{len(texts)} (step {meta['step']})")
        print(a.prompt + text)
    return 0
