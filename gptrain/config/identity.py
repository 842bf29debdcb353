"""The config keys that cannot change what a run trains, listed once with the reason for each; the
rest of the resolved config is the run's training identity.

A timeline (gptrain/checkpoint/retention.py) is identified by it: a requeued job whose config
differs from the one that started its timeline only in these keys (another head node's rendezvous
endpoint, a new rendezvous id, another node count with the same train.total_batch_size, logging,
checkpoint cadence, evaluations) continues that timeline; any other difference (optim.lr, the
model, the data, the seed, ...) is another training, which starts a new timeline. A whole section
is named by its name alone.

A timeline records its training keys too, so that a gptrain that has added a key since compares
them by meaning (`same_training`): a key the record lacks trains as before at its default (a key
is added with the default that keeps what earlier versions did).
"""

from __future__ import annotations

import functools
import hashlib
import json
import tomllib

from gptrain.config.load import Config, to_toml

NOT_TRAINING: dict[str, str] = {
    "train.micro_batch_size": "the data cursor counts windows: any split of train.total_batch_size trains the same batches",
    "train.micro_batch_cap": "the largest micro_batch_size = auto may pick: a split of the same batch",
    "train.compile": "torch.compile runs the same model and update, faster",
    "train.activation_checkpointing": "recomputes each block's activations in backward: the same gradients",
    "train.attention": "which kernel computes attention (speed choice, kept by a resumed run)",
    "train.loss": "how the output head's loss is computed (speed choice, kept by a resumed run)",
    "train.deterministic": "which kernels add in a fixed order: the same computation",
    "train.device": "where the run trains, as the node count; the model and update are the same",
    "train.max_skips": "only when consecutive skipped steps stop the run, never an update",
    "optim.muon_split": "which rank orthogonalises each Muon matrix: the same update",
    "eval": "evaluations and samples read the model and never change it",
    "checkpoint": "when and where checkpoints are saved, kept, mirrored and resumed from",
    "log": "what is logged and where",
    "dist": "how the job is launched and spread (endpoints, rendezvous ids, node counts, DDP or FSDP2, time-outs): train.total_batch_size fixes each step's batch",
    "run": "the run folder and the crash-loop stop: where the run lives, not what it trains",
}


def training_keys(config_text: str) -> dict:
    """The resolved config (to_toml's text) less the NOT_TRAINING keys: {section: {key: value}}."""
    config = tomllib.loads(config_text)
    out = {}
    for section, table in config.items():
        if section in NOT_TRAINING or not isinstance(table, dict):
            continue
        out[section] = {k: v for k, v in table.items() if f"{section}.{k}" not in NOT_TRAINING}
    return out


def training_identity(config_text: str) -> str:
    """A short hash of training_keys: equal for two configs that train the same run."""
    canonical = json.dumps(training_keys(config_text), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@functools.cache
def _defaults() -> dict:
    return training_keys(to_toml(Config()))


def same_training(saved: dict, now: dict) -> bool:
    """Whether training_keys `saved` (recorded, perhaps by an older gptrain) and `now` train the
    same run: each key equal, a key `saved` lacks at this gptrain's default; a saved key that no
    longer exists is a difference."""
    defaults, missing = _defaults(), object()
    for section in saved.keys() | now.keys():
        old, new = saved.get(section, {}), now.get(section, {})
        if not isinstance(old, dict):
            return False
        for key in old.keys() | new.keys():
            want = old[key] if key in old else defaults.get(section, {}).get(key, missing)
            if key not in new or want != new[key]:
                return False
    return True
