"""Building what a run trains: the model (random init, a preset, or pretrained weights), its
parallel wrapping, the optimizer and the precision. Shared by `gptrain train` and `gptrain bench`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from gptrain.config.load import Config, check_arch_of_folder
from gptrain.distributed import parallelize
from gptrain.distributed import runtime as dist
from gptrain.distributed.host import keep_freed_memory
from gptrain.errors import UserError
from gptrain.training import facts, recorded
from gptrain.training import float8 as fp8
from gptrain.training.choices import Choices, Shapes, decide, decide_muon_split
from gptrain.training.precision import (
    mixed_precision,
    resolve_dtype,
    set_determinism,
    set_matmul_precision,
)


def build_model(cfg: Config, vocab_size: int, saved_arch: dict | None = None, meta: bool = False):
    """The model to train, randomly initialised (preset or n_layer/n_head/n_embd) on the CPU, or
    from the pretrained folder of model.init_from. `saved_arch` (a checkpoint's model config)
    replaces that folder when a run started from it resumes: the checkpoint holds the weights.

    A random model is always constructed on the `meta` device, then materialised on the CPU and
    initialised by `init_weights()` alone (no wasted default init), so its values depend only on
    the seed; meta=True leaves it on `meta` for a sharded build (see init_sharded)."""
    m = cfg.model
    if m.init_from and saved_arch is None:
        return _pretrained(cfg, vocab_size)
    with torch.device("meta"):
        model = _random(cfg, vocab_size, saved_arch)
    if not meta:
        materialise(model, "cpu")
        model.init_weights()
    return model


def materialise(model: torch.nn.Module, device: str) -> None:
    """Allocate a meta-device model's tensors (uninitialised) on `device`, keeping tied weights
    tied (`Module.to_empty` alone would give the tied head a storage of its own)."""
    from gptrain.checkpoint.manager import shared_parameters

    aliases = shared_parameters(model)
    model.to_empty(device=device)
    for alias, source in aliases.items():
        owner, _, name = alias.rpartition(".")
        param = model.get_parameter(source)
        if model.get_parameter(alias) is not param:
            setattr(model.get_submodule(owner), name, param)


def _pretrained(cfg: Config, vocab_size: int):
    """The weights of model.init_from; their config.json sets the architecture (loading the
    config made model.arch the folder's, or refused another one: load.py init_from_arch)."""
    from gptrain.model.hf import load_hf_folder

    m = cfg.model
    model = load_hf_folder(m.init_from, dropout=m.dropout)
    check_arch_of_folder(m.arch, model.arch, m.init_from)  # the folder changed since the load
    c = model.config
    if getattr(c, "bias", None) is True and not m.bias:
        raise UserError(
            f"model.init_from = {m.init_from!r} loads GPT-2 weights, which have biases, but model.bias = false; drop --model.bias=false"
        )
    if c.vocab_size != vocab_size or c.block_size < cfg.train.seq_len:
        raise UserError(
            f"model.init_from = {m.init_from!r} has vocab {c.vocab_size} and context {c.block_size}, but the data's tokenizer has vocab {vocab_size} and train.seq_len = {cfg.train.seq_len}; "
            "prepare the data with the weights' tokenizer (e.g. --tokenizer gpt2) and use a seq_len within the context"
        )
    return model


def model_config_dict(cfg: Config, vocab_size: int) -> dict:
    """The [model] section as a model config dict (gptrain/model/arch.py config_from_dict): the
    block's own keys only."""
    from gptrain.model.gpt import PRESETS

    m = cfg.model
    if m.preset and m.preset not in PRESETS:
        raise UserError(f"model.preset = {m.preset!r}; allowed: {', '.join(PRESETS)} or empty")
    shape = (
        PRESETS[m.preset]
        if m.preset
        else {"n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.n_embd}
    )
    common = dict(vocab_size=vocab_size, block_size=m.block_size or cfg.train.seq_len)
    if m.arch == "gpt2":
        return {
            "arch": "gpt2",
            **common,
            **shape,
            "dropout": m.dropout,
            "gelu": m.gelu,
            "bias": m.bias,
        }
    own = {"n_kv_head": m.n_kv_head, "mlp_hidden": m.mlp_hidden, "softcap": m.softcap}
    return {"arch": m.arch, **common, **shape, **own, "dropout": m.dropout}


def _random(cfg: Config, vocab_size: int, saved_arch: dict | None):
    from gptrain.model.arch import build, config_from_dict

    m = cfg.model
    if m.init_from:  # resuming a run that started from pretrained weights: the checkpoint has them
        return build(config_from_dict({**saved_arch, "dropout": m.dropout}))
    return build(config_from_dict(model_config_dict(cfg, vocab_size)))


def check_saved_arch(model, saved_arch: dict | None) -> None:
    """A UserError where the checkpoint being resumed holds another block (model.arch), or has
    another GELU (no tensor shape would catch it) or another bias setting (its tensors would not
    load) than the config asks for. Checkpoints without "arch" hold the gpt2 block."""
    if saved_arch is None:
        return
    saved, now = saved_arch.get("arch", "gpt2"), getattr(model, "arch", "gpt2")
    if saved != now:
        raise UserError(
            f"model.arch = {now!r} but the checkpoint being resumed holds the {saved!r} block; set --model.arch={saved} or use a new run.dir"
        )
    if now != "gpt2":
        return
    for key, before in (("gelu", "tanh"), ("bias", True)):  # checkpoints from before the key
        saved, now = saved_arch.get(key, before), getattr(model.config, key)
        if saved != now:
            value = str(saved).lower() if isinstance(saved, bool) else saved
            raise UserError(
                f"model.{key} = {now!r} but the checkpoint being resumed was trained with {saved!r}; set --model.{key}={value} or use a new run.dir"
            )


class Built(tuple):
    """build_training's result: unpacks as (model, wrapped, optimizer, compute dtype, autocast,
    scaler); `.choices` holds the measured speed choices behind it (training/choices.py)."""

    def __new__(cls, items: tuple, choices: Choices):
        built = super().__new__(cls, items)
        built.choices = choices
        return built


def build_training(
    cfg: Config,
    info: dist.DistInfo,
    vocab_size: int,
    dtype: str,
    compile: bool,
    saved_arch: dict | None = None,
    saved_choices: dict | None = None,
    micro_batch: int = 0,
) -> Built:
    """(model, wrapped, optimizer, compute dtype, autocast, scaler), in this order: the model with
    the same initialisation on every rank (same seed), parallelism applied from outside, then the
    optimizer over the (possibly sharded) parameters. train.dtype (`dtype`), train.attention,
    train.loss, train.float8 and optim.muon_dtype = auto are decided by timing the run's shapes
    (speed_choices), or taken from the checkpoint a run resumes (`saved_choices`).

    FSDP2 with a random init: the model is built on the `meta` device (no memory), sharded, then
    each rank allocates only its shards (`to_empty`) and initialises them (`init_sharded`), so no
    rank ever holds the full model, and the init equals the single-process one bit for bit."""
    from gptrain.training.optim import build_optimizer

    set_determinism(cfg.train.deterministic)  # before the first matmul (cuBLAS reads its config)
    torch.manual_seed(cfg.train.seed)
    fsdp = parallelize.shards(cfg.dist, info)
    # pretrained weights (not resuming) are loaded whole on every rank, then sharded
    on_meta = fsdp and not (cfg.model.init_from and saved_arch is None)
    model = build_model(cfg, vocab_size, saved_arch, meta=on_meta)
    check_saved_arch(model, saved_arch)
    if not on_meta:
        model = model.to(info.device)
    if info.device_type == "cpu":  # before the timings, so that they see the training's allocator:
        keep_freed_memory()  # no page faults for every step's activations (host.py)
    set_matmul_precision(info.device_type, cfg.train.tf32)  # before the timings and the peak
    choices = speed_choices(cfg, info, model, dtype, fsdp, saved_choices, micro_batch, compile)
    ptdtype = resolve_dtype(dtype, info.device_type, fsdp, measured=choices.dtype)
    model.set_attention(attention_kernel(cfg.train.attention, choices.attention))
    model.set_loss(choices.loss)  # train.loss, or auto's measured path
    wrapped = parallelize.wrap_model(
        model,
        cfg.dist,
        info=info,
        compile=compile,
        param_dtype=ptdtype,
        activation_checkpointing=cfg.train.activation_checkpointing,
        float8=fp8.parse(choices.float8 and choices.float8.layers),  # none: off or undecided
    )
    if on_meta:  # the same RNG state as build_model's init_weights above: nothing drew since
        init_sharded(model, info.device)
    optimizer = build_optimizer(
        model,
        cfg.optim,
        device_type=info.device_type,
        muon_dtype=choices.muon_torch_dtype,
        split_choice=choices.muon_split,
    )
    autocast, scaler = mixed_precision(ptdtype, info.device_type)
    return Built((model, wrapped, optimizer, ptdtype, autocast, scaler), choices)


def speed_choices(
    cfg,
    info,
    model,
    dtype: str,
    fsdp: bool = False,
    saved: dict | None = None,
    mb: int = 0,
    compile: bool | None = None,
) -> Choices:
    """The run's measured speed choices (training/choices.py, `decide`): cfg (a config.Config)
    and its built `model` give the shapes (the micro-batch a CPU uses, the model's block, its Muon
    matrices, its vocabulary), `dtype` is train.dtype and `compile` train.compile (bench passes
    its own), `fsdp` whether it shards. Every rank's facts are gathered first (training/facts.py:
    one all-gather), so that each choice is one every rank can run; decided on the main process,
    every rank gets the same Choices. `saved`: the choices a resumed checkpoint recorded
    (recorded.record()); a resumed run keeps them for every key still auto, so that it computes
    exactly as before whatever the cache holds (how: "checkpoint"), except one that cannot run
    here: that one alone is decided again, with a warning; an explicit value that differs from
    its recorded choice is a warning too (training/recorded.py)."""
    from gptrain.training import batch
    from gptrain.training.optim import muon_split

    c, t, o = model.config, cfg.train, cfg.optim
    muon = o.name == "muon"
    matrices = {tuple(p.shape) for p in muon_split(model, 0.0)[0]} if muon else set()
    mb = mb or batch.plan(t, info.world_size)[0]  # what a CPU uses, a GPU tries first
    vocab = {"vocab": c.vocab_size, "padded_vocab": c.padded_vocab_size}
    linears = tuple(sorted(set(parallelize.float8_layers(model).values())))
    mat, key = tuple(sorted(matrices)), block_key(model)
    shapes = ModelShapes(mb, t.seq_len, c.n_layer, c.n_embd, c.n_head, *key, mat, o.muon_ns_steps)
    shapes = replace(shapes, **vocab, linears=linears, model=timed_block_config(model))
    muon_dtype = o.muon_dtype if muon else None
    asked = {"dtype": dtype, "attention": t.attention, "muon_dtype": muon_dtype, "loss": t.loss}
    asked["float8"] = t.float8
    compile = t.compile if compile is None else compile
    how = dict(fsdp=fsdp, compiled=compile)  # FSDP2: blocks compiled, loss eager (decide)
    limits = facts.agree(facts.gather(info))  # collective: what every rank can run

    def choose() -> Choices:
        return decide(info.device, shapes, **asked, **how, limits=limits, recorded=saved)

    out = dist.from_main(info, choose)
    if muon:
        start = time.perf_counter()
        matrices = muon_split(model, 0.0)[0]
        split = decide_muon_split(info, matrices, o, out, fsdp, saved, limits=limits)
        out.muon_split, out.how["muon_split"], out.split_ms = split
        out.seconds += time.perf_counter() - start
    out.warnings += recorded.overridden(out.decisions() | {"compile": compile}, out.how, saved)
    return out


@dataclass(frozen=True)
class ModelShapes(Shapes):
    """choices.Shapes with the model's own config (gptrain/model/arch.py config_to_dict, as
    (key, value) pairs), from which training/timing.py builds the block it times."""

    model: tuple = ()


def block_key(model) -> tuple[str, bool]:
    """The (gelu, bias) slots of choices.Shapes, which key the block's cached timings: GPT-2's
    own values, as ever; for another block its arch and config.shape_key(), so that no two blocks
    share a timing."""
    c = model.config
    if model.arch == "gpt2":
        return c.gelu, c.bias
    return " ".join(str(v) for v in (model.arch, *c.shape_key())), False


def timed_block_config(model) -> tuple:
    """The model's config as (key, value) pairs (ModelShapes.model)."""
    from gptrain.model.arch import config_to_dict

    return tuple(sorted(config_to_dict(model.config).items()))


def attention_kernel(choice: str, measured: str) -> str:
    """train.attention: an explicit sdpa or matmul as given; auto is the kernel measured faster
    on one block of the run's shapes (choices.py; matmul only while its kept probabilities fit)."""
    return measured if choice == "auto" else choice


def init_sharded(model: torch.nn.Module, device: str) -> None:
    """Materialise a sharded model built on `meta`: allocate each rank's shards on `device`, then
    run the model's own `init_weights()` so that every shard gets exactly the values the same
    parameter has after a single-process init with the same seed.

    Sharded random ops cannot give that by themselves (on CPU each rank would draw its shard from
    the start of its own stream). So, while init_weights runs, each in-place init op on a sharded
    parameter (nn.init.normal_ / zeros_ / ones_ / ..., Tensor.normal_ / zero_ / fill_ / uniform_) is applied to a full CPU tensor of the parameter's
    shape, drawn from the CPU generator in the same order as a single process draws it (the
    single-process model is also initialised on the CPU, then moved), and each rank copies out its
    own shard. Peak extra memory: the largest single parameter (the embedding), never the model."""
    materialise(model, device)
    with _FullTensorInit():
        model.init_weights()


class _FullTensorInit(torch.overrides.TorchFunctionMode):
    """Init ops on DTensors computed on the full tensor (CPU), then sliced to the local shard."""

    OPS = {  # nn.init.* hand DTensors to the mode themselves; Tensor methods for direct calls
        *(
            getattr(torch.nn.init, n)
            for n in ("normal_", "zeros_", "ones_", "uniform_", "trunc_normal_", "constant_")
        ),
        *(getattr(torch.Tensor, n) for n in ("normal_", "zero_", "fill_", "uniform_")),
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor, distribute_tensor

        kwargs = dict(kwargs or {})
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
        if func not in self.OPS or not isinstance(target, DTensor):
            return func(*args, **kwargs)
        full = torch.empty(target.shape, dtype=target.dtype, device="cpu")
        if args:
            args = (full, *args[1:])
        else:
            kwargs["tensor"] = full
        func(*args, **kwargs)  # the same draw as the single-process init
        # slice locally (no communication): every rank computed the same full tensor
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
        return target
