"""Config values that are wrong on their own or contradict each other: one UserError naming the
key, the value and the fix. Called by config.load_config on every config it builds (world-size
checks come later, in batch.py and dist.check_options). Imports no other config module.
"""

from __future__ import annotations

from dataclasses import fields

from gptrain.errors import UserError


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def validate(cfg) -> None:
    """Values of a config.Config that are wrong on their own or contradict each other (world-size
    checks come later). Not annotated with Config: config.py imports this module, not the reverse."""
    for part in fields(cfg):
        section, sec = part.name, getattr(cfg, part.name)
        for f in fields(sec):
            choices = f.metadata.get("choices")
            value = getattr(sec, f.name)
            _check(
                choices is None or value in choices,
                f"{section}.{f.name} = {value!r}; allowed: {', '.join(choices or ())}",
            )
    t, m = cfg.train, cfg.model
    for key in ("micro_batch_cap", "seq_len", "total_batch_size", "max_steps"):
        _check(getattr(t, key) >= 1, f"train.{key} = {getattr(t, key)} must be >= 1")
    mb = t.micro_batch_size
    _check(mb == "auto" or mb >= 1, f"train.micro_batch_size = {mb} must be >= 1 or auto")
    _check(
        not (cfg.dist.mode == "fsdp" and t.dtype == "float16"),
        "dist.mode = 'fsdp' with train.dtype = 'float16' is not supported (FSDP2 has no sharded float16 gradient scaler); use train.dtype=bfloat16 (GPUs with compute capability >= 8.0), float32, or dist.mode=ddp",
    )
    o = cfg.optim
    _check(o.lr > 0, f"optim.lr = {o.lr} must be > 0")
    _check(0 <= o.min_lr <= o.lr, f"optim.min_lr = {o.min_lr} must be in [0, optim.lr = {o.lr}]")
    _check(
        0 <= o.warmup_steps <= t.max_steps,
        f"optim.warmup_steps = {o.warmup_steps} must be in [0, train.max_steps = {t.max_steps}]",
    )
    _check(
        0 < o.decay_fraction <= 1,
        f"optim.decay_fraction = {o.decay_fraction} must be in (0, 1], e.g. 0.2 (the last 20% of the steps)",
    )
    _check(o.weight_decay >= 0, f"optim.weight_decay = {o.weight_decay} must be >= 0")
    for key in ("beta1", "beta2", "muon_momentum"):
        _check(0 <= getattr(o, key) < 1, f"optim.{key} = {getattr(o, key)} must be in [0, 1)")
    _check(o.eps > 0, f"optim.eps = {o.eps} must be > 0")
    _check(o.muon_lr > 0, f"optim.muon_lr = {o.muon_lr} must be > 0")
    _check(o.muon_ns_steps >= 1, f"optim.muon_ns_steps = {o.muon_ns_steps} must be >= 1")
    if o.name == "muon":  # gptrain's own Muon (training/muon.py): no torch.optim.Muon needed
        _check(
            cfg.dist.mode != "fsdp",
            "optim.name = 'muon' with dist.mode = 'fsdp' is not supported (Muon would orthogonalise each rank's shard, not the whole matrix); use dist.mode = 'ddp' or optim.name = 'adamw'",
        )
    _check(o.grad_clip >= 0, f"optim.grad_clip = {o.grad_clip} must be >= 0 (0 disables clipping)")
    _check(0 <= m.dropout < 1, f"model.dropout = {m.dropout} must be in [0, 1)")
    _check(
        not (m.init_from and m.preset),
        f"model.init_from = {m.init_from!r} and model.preset = {m.preset!r}: the weights' config.json sets the architecture; leave model.preset empty",
    )
    if not m.preset:
        for key in ("n_layer", "n_head", "n_embd"):
            _check(getattr(m, key) >= 1, f"model.{key} = {getattr(m, key)} must be >= 1")
        _check(
            m.n_embd % m.n_head == 0,
            f"model.n_embd = {m.n_embd} is not divisible by model.n_head = {m.n_head}",
        )
    _check(
        m.block_size == 0 or m.block_size >= t.seq_len,
        f"model.block_size = {m.block_size} is shorter than train.seq_len = {t.seq_len}; use 0 to follow seq_len",
    )
    _check(cfg.data.stride >= 0, f"data.stride = {cfg.data.stride} must be >= 0 (0 means seq_len)")
    for key in ("every", "sample_every", "hellaswag_every", "hellaswag_limit"):
        _check(getattr(cfg.eval, key) >= 0, f"eval.{key} must be >= 0")
    _check(
        cfg.eval.tokens >= t.seq_len,
        f"eval.tokens = {cfg.eval.tokens} is less than one window of train.seq_len = {t.seq_len}",
    )
    _check(cfg.checkpoint.every >= 0, "checkpoint.every must be >= 0")
    _check(
        cfg.checkpoint.every_minutes >= 0,
        f"checkpoint.every_minutes = {cfg.checkpoint.every_minutes} must be >= 0 (0: off)",
    )
    c = cfg.checkpoint
    _check(
        c.keep_last >= 1,
        f"checkpoint.keep_last = {c.keep_last} must be >= 1 (the newest is always kept)",
    )
    _check(
        c.keep_every >= 0,
        f"checkpoint.keep_every = {c.keep_every} must be >= 0 (0 keeps no milestones)",
    )
    if c.async_:
        _check(
            cfg.dist.mode == "fsdp",
            f"checkpoint.async = true with dist.mode = {cfg.dist.mode!r}: background saving applies only to the sharded (DCP) checkpoints of FSDP2 runs, and a {cfg.dist.mode} run writes full checkpoints; use checkpoint.async=false (or dist.mode=fsdp)",
        )
        import torch
        import torch.distributed.checkpoint as dcp

        _check(
            hasattr(dcp, "async_save"),
            f"checkpoint.async = true needs torch.distributed.checkpoint.async_save (torch >= 2.3); this is torch {torch.__version__}: upgrade torch or use checkpoint.async=false",
        )
    _check(t.max_skips >= 1, f"train.max_skips = {t.max_skips} must be >= 1")
    _check(
        t.spike_window >= 2,
        f"train.spike_window = {t.spike_window} must be >= 2 (a standard deviation needs 2 steps), e.g. 128",
    )
    _check(t.spike_z > 0, f"train.spike_z = {t.spike_z} must be > 0, e.g. 6")
    r = cfg.checkpoint.resume
    _check(
        r in ("auto", "latest", "none") or r.isdigit(),
        f"checkpoint.resume = {r!r}; allowed: auto, latest, none or a step number",
    )
    _check(cfg.log.every >= 1, f"log.every = {cfg.log.every} must be >= 1")
    _check(
        cfg.run.max_failed_attempts >= 0,
        f"run.max_failed_attempts = {cfg.run.max_failed_attempts} must be >= 0 (0: no crash-loop stop)",
    )
    _check(cfg.dist.timeout_s >= 1, f"dist.timeout_s = {cfg.dist.timeout_s} must be >= 1")
    h = cfg.dist.hang_timeout_s
    _check(
        h == "auto" or (isinstance(h, int) and h >= 0),
        f"dist.hang_timeout_s = {h!r}; allowed: auto, a whole number of seconds, or 0 (off)",
    )
    nn = cfg.dist.nnodes
    low, colon, high = str(nn).partition(":")
    _check(
        low.isdigit() and (high.isdigit() or not colon) and 1 <= int(low) <= int(high or low),
        f"dist.nnodes = {nn!r}; allowed: a whole number >= 1, or MIN:MAX with 1 <= MIN <= MAX for an elastic job, e.g. 1:4",
    )
    ep = cfg.dist.rdzv_endpoint
    _check(
        str(nn) in ("1", "1:1") or ep.rpartition(":")[2].isdigit(),
        f"dist.nnodes = {cfg.dist.nnodes} needs dist.rdzv_endpoint=HOST:PORT (a port on one of the nodes), got {ep!r}",
    )
    n = cfg.dist.nproc_per_node
    _check(
        n == "auto" or (n.isdigit() and int(n) >= 1),
        f"dist.nproc_per_node = {n!r}; allowed: a whole number >= 1 or auto",
    )
