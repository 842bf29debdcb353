"""`gptrain eval`: validation loss/bpb and HellaSwag for a run's checkpoint or a Hugging Face GPT-2 or NanoChat folder.

    gptrain eval --run runs/debug --tasks val,hellaswag               # latest checkpoint, its own data
    gptrain eval --run runs/debug --step 500 --tasks hellaswag --hellaswag-limit 1000
    gptrain eval --hf exports/gpt2 --tasks val,hellaswag --data data/fineweb-gpt2
    torchrun --nproc_per_node=8 -m gptrain eval --hf DIR --tasks hellaswag    # examples split over ranks

Both kinds of model go through the same code (gptrain's own GPT or NanoChat, the same scorer, the
same validation tokens), so a run compares with any GPT-2 or NanoChat checkpoint on the same
footing. Prints a table and writes
the numbers as JSON (--out; default RUN/eval/step_N.json for a run, ./eval-NAME.json for --hf).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from gptrain.data.loader import Dataset
from gptrain.distributed import runtime as dist
from gptrain.errors import ArgParser, UserError
from gptrain.evals.hellaswag import HellaSwag, load_examples
from gptrain.evals.val import ValLoss

TASKS = ("val", "hellaswag")


def hf_tokenizer(folder: Path, vocab_size: int, override: str = ""):
    """The tokenizer of a Hugging Face folder: --tokenizer, else the one gptrain export
    recorded, else GPT-2's for a 50257-token vocabulary, else its tokenizer.json as a BPE."""
    from gptrain.data.tokenizers import load_tokenizer

    if override:
        return load_tokenizer(override)
    record = folder / "gptrain_export.json"
    if record.is_file():
        ident = dict(json.loads(record.read_text()).get("tokenizer", {}))
        if ident.get("name") == "bpe":
            ident["path"] = str(folder / "tokenizer.json")
        return load_tokenizer(ident)
    if vocab_size == 50257:
        return load_tokenizer("gpt2")
    if (folder / "tokenizer.json").is_file():
        return load_tokenizer(f"bpe:{folder / 'tokenizer.json'}")
    raise UserError(
        f"cannot tell the tokenizer of {folder} (vocab {vocab_size}); pass --tokenizer byte|gpt2|bpe:PATH"
    )


def load_subject(a, device) -> tuple:
    """(model in eval mode, tokenizer, name, step, data dir recorded with it or None)."""
    if a.run:
        from gptrain.evals.generate import load_model

        model, tokenizer, meta = load_model(a.run, a.step, device)
        return model, tokenizer, Path(a.run).name, meta.get("step"), meta.get("data_dir")
    from gptrain.model.hf import load_hf_folder

    model = load_hf_folder(a.hf).to(device).eval()
    tokenizer = hf_tokenizer(Path(a.hf), model.config.vocab_size, a.tokenizer)
    if tokenizer.vocab_size != model.config.vocab_size:
        raise UserError(
            f"tokenizer vocab {tokenizer.vocab_size} != model vocab {model.config.vocab_size} in {a.hf}; pass --tokenizer"
        )
    return model, tokenizer, Path(a.hf).resolve().name, None, None


def validation(
    model, tokenizer, data_dir, eval_tokens: int, seq_len: int, batch: int, info
) -> ValLoss:
    """The val task on eval_tokens validation tokens spread evenly over the data folder's val split."""
    dataset = Dataset(data_dir)
    if dataset.manifest["tokenizer"].get("hash") != tokenizer.hash:
        raise UserError(
            f"--data {data_dir} was prepared with tokenizer {dataset.manifest['tokenizer'].get('name')!r}, the model uses {tokenizer.name!r}; prepare the data with the model's tokenizer"
        )
    byte_lengths = torch.as_tensor(tokenizer.token_byte_lengths(), device=info.device)
    return ValLoss(
        dataset,
        seq_len=seq_len,
        micro_batch_size=batch,
        eval_tokens=eval_tokens,
        byte_lengths=byte_lengths,
    )


def hellaswag(model, tokenizer, source: str, limit: int, batch_tokens: int, info) -> HellaSwag:
    """The hellaswag task on the first `limit` examples of `source` (0: all of them)."""
    examples = dist.local_main_first(info, lambda: load_examples(source, limit))
    return HellaSwag(examples, tokenizer, model.config.block_size, batch_tokens)


def format_table(name: str, step, results: dict) -> str:
    """The printed table: the model (and step), then one row per result."""
    rows = [("model", name + (f" (step {step})" if step is not None else ""))]
    for key, value in results.items():
        rows.append((key, f"{value:.4f}" if isinstance(value, float) else str(value)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def val_tokens(text: str) -> int | str:
    """--val-tokens: auto, or a whole number >= 0 (0: the whole split)."""
    if text == "auto":
        return text
    if text.isdigit():
        return int(text)
    raise UserError(
        f"--val-tokens {text!r}: give a number of tokens, 0 for the whole split, or auto"
    )


def arg_parser() -> ArgParser:
    """`gptrain eval`'s options."""
    p = ArgParser(prog="gptrain eval", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run directory (its latest checkpoint, or --step)")
    src.add_argument("--hf", help="a Hugging Face GPT-2 or NanoChat folder (config.json + weights)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step of --run")
    p.add_argument("--tasks", default="val,hellaswag", help="comma-separated: val, hellaswag")
    p.add_argument("--data", default="", help="prepared data folder for val (default: the run's)")
    p.add_argument(
        "--val-tokens",
        type=val_tokens,
        default="auto",
        help="validation tokens, spread over the split: a number, 0 for all, auto (65,536 or all)",
    )
    p.add_argument(
        "--hellaswag",
        default="hellaswag",
        help="hellaswag_val.jsonl path or 'hellaswag' (built-in)",
    )
    p.add_argument("--hellaswag-limit", type=int, default=0, help="first N examples (0 = all)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per forward")
    p.add_argument("--tokenizer", default="", help="tokenizer of --hf (default: detected)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default="", help="JSON file to write")
    return p


def checked_tasks(a) -> list[str]:
    """The task names of --tasks, after checking the options that need no model."""
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise UserError(f"--tasks {a.tasks!r}; choose from: {', '.join(TASKS)}")
    if a.batch_tokens < 1:
        raise UserError("--batch-tokens must be >= 1")
    if a.hellaswag_limit < 0:
        raise UserError("--hellaswag-limit must be >= 0 (0 = all examples)")
    if a.step is not None and not a.run:
        raise UserError("--step goes with --run")
    return tasks


def build_tasks(a, tasks: list[str], model, tokenizer, run_data, info) -> list:
    """The chosen tasks, built in --tasks' fixed order (val, then hellaswag)."""
    chosen = []  # every task has evals/task.py's shape
    if "val" in tasks:
        data = a.data or run_data
        if not data:
            raise UserError("--tasks val needs --data DIR (a folder made by gptrain prepare)")
        seq_len = model.config.block_size
        chosen.append(
            validation(
                model,
                tokenizer,
                data,
                a.val_tokens,
                seq_len,
                max(1, a.batch_tokens // seq_len),
                info,
            )
        )
    if "hellaswag" in tasks:
        chosen.append(
            hellaswag(model, tokenizer, a.hellaswag, a.hellaswag_limit, a.batch_tokens, info)
        )
    return chosen


def run_tasks(chosen: list, model, info, autocast) -> tuple[dict, dict]:
    """(results, details): every task's metrics and numeric details (the table), and its other
    details (lists: the JSON only)."""
    results, details = {}, {}
    for task in chosen:
        outcome = task.run(model, info, autocast)
        results |= outcome.metrics
        for key, value in outcome.details.items():  # numbers go in the table, lists in the JSON
            (results if isinstance(value, int | float) else details)[key] = value
    return results, details


def write_record(a, name: str, step, record: dict, results: dict) -> None:
    """Write the JSON record atomically (--out, else the default path) and print the table."""
    out = Path(a.out) if a.out else None
    if out is None:
        out = Path(a.run) / "eval" / f"step_{step:08d}.json" if a.run else Path(f"eval-{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out)
    print(format_table(name, step, results))
    print(f"wrote {out}")


def main(argv: list[str]) -> int:
    from gptrain.training.precision import mixed_precision, resolve_dtype

    a = arg_parser().parse_args(argv)
    tasks = checked_tasks(a)
    info = dist.DistInfo.from_env(a.device)
    dist.init(info)
    finished = False
    try:
        model, tokenizer, name, step, run_data = load_subject(a, info.device)
        ptdtype = resolve_dtype(a.dtype, info.device_type)
        autocast, _ = mixed_precision(ptdtype, info.device_type)
        chosen = build_tasks(a, tasks, model, tokenizer, run_data, info)
        results, details = run_tasks(chosen, model, info, autocast)
        if info.is_main:
            record = {
                "model": a.run or a.hf,
                "step": step,
                "tokenizer": tokenizer.name,
                "dtype": str(ptdtype).removeprefix("torch."),
                "world_size": info.world_size,
                **results,
                **details,
            }
            write_record(a, name, step, record, results)
        finished = True
    finally:
        dist.teardown(wait_for_peers=finished)
    return 0
