"""A resumed run's recorded speed choices: reused, decided again only where they cannot run, and
a line for every explicit value that differs from them.

A checkpoint records the speed choices (training/choices.py, Choices.decisions(): train.dtype,
train.attention, train.loss, train.float8, optim.muon_dtype, optim.muon_split, train.compile and
the resolved train.micro_batch_size), so that a resumed run computes exactly as the uninterrupted
one whatever the speed-choice cache holds or the device's free memory says now. Each key still
auto keeps its recorded value untimed (how: "checkpoint"). A recorded value that cannot run on
this run's ranks (float8 layers without FP8 matmuls or torchao, full logits without the memory,
bf16 Muon where bf16 is emulated, redundant Muon on ranks that differ, a micro-batch that does
not divide the batch or fit) is decided again, that key alone, with one warning naming it and
both values. An explicit value that differs from the recorded one wins, with one warning naming
the key and both values: the numerics then differ from the uninterrupted run's.
"""

from __future__ import annotations

from gptrain.training import float8 as fp8

# the config key of each recorded choice, as lines name it
NAMES = {"dtype": "train.dtype", "attention": "train.attention", "loss": "train.loss"}
NAMES |= {"float8": "train.float8", "muon_dtype": "optim.muon_dtype", "compile": "train.compile"}
NAMES |= {"muon_split": "optim.muon_split", "micro_batch_size": "train.micro_batch_size"}


def record(choices, compile: bool, micro_batch: int) -> dict:
    """What a checkpoint records as its "speed_choices": the Choices' decisions, train.compile and
    the micro-batch the run resolved (training/batch.py)."""
    return choices.decisions() | {"compile": compile, "micro_batch_size": micro_batch}


def keep(device: str, asked: dict, recorded: dict, limits, no_room) -> tuple[dict, dict]:
    """({key: value} of the `recorded` choices a run keeps, {key: (value, why)} of those it must
    decide again): keys `asked` as auto only (an explicit value wins), runnable on every rank
    (`limits`, training/facts.py; `no_room()`: why the full logits do not fit, or None)."""
    kept, again = {}, {}
    for key, value in recorded.items():
        if asked.get(key) != "auto" or value is None:
            continue
        why = None
        if key == "float8" and value != "off":
            dtype = recorded.get("dtype") if asked.get("dtype") == "auto" else asked.get("dtype")
            why = fp8.cannot_run(device, dtype, limits)
        elif key == "loss" and value == "full":
            why = no_room()
        if why:
            again[key] = (value, why)
        else:
            kept[key] = value
    return kept, again


def decided_again(key: str, old, why: str, new) -> str:
    """The line of a recorded choice this run cannot keep."""
    return f"the checkpoint's {NAMES[key]} = {old} cannot run here ({why}); decided again: {new}, so the numerics differ from the uninterrupted run"


def again_lines(now: dict, again: dict) -> list[str]:
    """decided_again's line for each of `again` ({key: (old, why)}), `now` being the decisions."""
    return [decided_again(k, old, why, now.get(k, "off")) for k, (old, why) in again.items()]


def overridden(now: dict, how: dict, saved: dict | None) -> list[str]:
    """One line per explicit value that differs from the choice a resumed checkpoint recorded:
    `now` (Choices.decisions()) and `how` (Choices.how: "config" for an explicit value;
    train.compile is always explicit) against `saved` (the checkpoint's decisions). The
    micro-batch is batch.resolve's (it is resolved later)."""
    lines = []
    for key, old in (saved or {}).items():
        explicit = key == "compile" or how.get(key) == "config"
        if key in now and key != "micro_batch_size" and explicit and now[key] != old:
            lines.append(overrides_line(key, now[key], old))
    return lines


def overrides_line(key: str, new, old) -> str:
    """The line of an explicit value that differs from the checkpoint's recorded choice."""
    return f"{NAMES[key]} = {new} (explicit) differs from the checkpoint's recorded {old}; the explicit value wins, so the numerics differ from the uninterrupted run"
