"""The evaluator: it says which evaluations are due at a step (validation loss and bits/byte,
HellaSwag, a text sample; each every N steps and at the last step) and runs them on every rank
(FSDP2 needs every rank in each forward); the main process logs their lines."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gptrain.config.sections import EvalConfig
from gptrain.distributed import faults
from gptrain.evals.hellaswag import HellaSwag
from gptrain.evals.val import ValLoss

EVAL_KEYS = ("val_loss", "val_bpb", "hellaswag_acc", "hellaswag_acc_norm")


@dataclass(frozen=True)
class Due:
    val: bool = False
    hellaswag: bool = False
    sample: bool = False

    def __bool__(self) -> bool:
        return self.val or self.hellaswag or self.sample


def _every(n: int, step: int, last_step: bool) -> bool:
    return last_step or (n > 0 and step % n == 0)


class Evaluator:
    """Validation, HellaSwag and samples of one run, and the best validation loss so far."""

    def __init__(self, e: EvalConfig, val: ValLoss, hellaswag: HellaSwag | None, tokenizer, seed):
        self.e, self.val, self.hellaswag, self.tokenizer, self.seed = (
            e,
            val,
            hellaswag,
            tokenizer,
            seed,
        )
        self.best: dict = {}  # best_val_loss, best_val_step (also in each checkpoint's meta.json)

    def due(self, step: int, last_step: bool) -> Due:
        e = self.e
        return Due(
            val=_every(e.every, step, last_step),
            hellaswag=self.hellaswag is not None and _every(e.hellaswag_every, step, last_step),
            sample=_every(e.sample_every, step, last_step),
        )

    def run(self, step: int, due: Due, wrapped, info, autocast, logger, watchdog) -> dict:
        """Collective: the due evaluations' metrics; each logs one line and is watched as its
        own phase (val, hellaswag, sample), with its own hang budget."""
        if due:
            faults.eval_error(step)  # GPTRAIN_FAULT=eval_error@STEP: this evaluation raises
            faults.kill_eval(step)  # GPTRAIN_FAULT=kill_eval@STEP: SIGKILL inside this evaluation
        out = {}
        if due.val:
            watchdog.enter("val", step)
            val = self.val.run(wrapped, info, autocast)
            out.update(val.metrics)
            logger.text(f"step {step}: {val.line}")
            if out["val_loss"] < self.best.get("best_val_loss", math.inf):
                self.best.update(best_val_loss=out["val_loss"], best_val_step=step)
        if due.hellaswag:
            watchdog.enter("hellaswag", step)
            scored = self.hellaswag.run(wrapped, info, autocast)
            out.update(scored.metrics)
            logger.text(f"step {step}: {scored.line}")
        if due.sample:
            watchdog.enter("sample", step)
            logger.text(
                f"step {step}: sample: {self.e.sample_prompt}{self._sample(wrapped, info, autocast)}"
            )  # noqa: E501
        return out

    def _sample(self, wrapped, info, autocast) -> str:
        from gptrain.evals.generate import generate_text

        with autocast:
            return generate_text(
                wrapped,
                self.tokenizer,
                self.e.sample_prompt,
                max_new_tokens=self.e.sample_tokens,
                temperature=0.8,
                top_k=200,
                num_samples=1,
                seed=self.seed,
                device=info.device,
            )[0]
