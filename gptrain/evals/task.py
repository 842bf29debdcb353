"""The one shape every evaluation task has, so that the training loop (training/run.py) and
`gptrain eval` (commands/eval.py) run any task the same way. A task is built once for a run (its
data loaded, verified and rendered for the tokenizer and context) and then run any number of
times:

    outcome = task.run(model, info, autocast)   # collective: every rank calls it
    outcome.metrics   # flat keys with the task's prefix (val_loss, hellaswag_acc, ...): what
                      # metrics.jsonl, TensorBoard and W&B receive
    outcome.line      # one line for train.log and the console
    outcome.details   # what `gptrain eval` adds to its table and JSON: counts, speed,
                      # per-example predictions (may be empty)

Instances: `ValLoss` (evals/val.py) and `HellaSwag` (evals/hellaswag.py). A new task is a class
with a `name` (its name in `gptrain eval --tasks` and the prefix of its metric keys) and this
`run` method; see docs/architecture.md, "An eval task".
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Outcome:
    """What one run of a task gives (see above)."""

    metrics: dict[str, float]
    line: str
    details: dict = field(default_factory=dict)
