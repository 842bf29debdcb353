"""The whole Config (one field per section of sections.py, and the checks that involve two
sections), how it is loaded and how it is written back.

Loading: defaults, then `--config FILE` (TOML), then `section.key=value` overrides. Each value is
type-checked as it is read (an unknown section or key, or a value of the wrong type: a UserError
naming the key, the value and what is allowed); then `Config.check()` runs each section's own
checks and the cross-section ones. The resolved config is saved as run.dir/config.toml (to_toml).
"""

from __future__ import annotations

import dataclasses
import json
import keyword
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from gptrain.config.fields import check, check_choices
from gptrain.config.sections import (
    ARCHS,
    GPT2_ONLY,
    NANOCHAT_ONLY,
    CheckpointConfig,
    DataConfig,
    DistConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from gptrain.errors import UserError


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def check(self) -> None:
        """Each section's own checks, then those that involve two sections (world-size checks
        come later: training/batch.py, distributed/launch.py)."""
        for f in fields(self):
            section = getattr(self, f.name)
            check_choices(f.name, section)
            section.check()
        t, o, d = self.train, self.optim, self.dist
        check(
            not (d.mode == "fsdp" and t.dtype == "float16"),
            "dist.mode = 'fsdp' with train.dtype = 'float16' is not supported (FSDP2 has no sharded float16 gradient scaler); use train.dtype=bfloat16 (GPUs with compute capability >= 8.0), float32, or dist.mode=ddp",
        )
        check(
            o.warmup_steps <= t.max_steps,
            f"optim.warmup_steps = {o.warmup_steps} must be in [0, train.max_steps = {t.max_steps}]",
        )
        check(
            not (o.name == "muon" and o.muon_split == "redundant" and d.mode == "fsdp"),
            "optim.muon_split = 'redundant' with dist.mode = 'fsdp': no rank holds a whole sharded matrix to orthogonalise (each is gathered to one owner rank); use optim.muon_split=split or auto",
        )
        b = self.model.block_size
        check(
            b == 0 or b >= t.seq_len,
            f"model.block_size = {b} is shorter than train.seq_len = {t.seq_len}; use 0 to follow seq_len",
        )
        n = self.eval.tokens
        check(
            n in ("auto", 0) or n >= t.seq_len,
            f"eval.tokens = {n} is less than one window of train.seq_len = {t.seq_len}; use at least {t.seq_len}, or 0 for the whole val split",
        )


SECTIONS = {f.name: f.default_factory for f in fields(Config)}
# keys that older configs had under [train]
MOVED_TO_OPTIM = ("lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip")


def key_name(field_name: str) -> str:
    """The config key of a field: its name, less the `_` that a Python keyword needs (async_)."""
    bare = field_name.removesuffix("_")
    return bare if keyword.iskeyword(bare) else field_name


def field_types(section_cls) -> dict[str, type]:
    """{config key: type} of a section's fields."""
    hints = typing.get_type_hints(section_cls)
    return {key_name(f.name): hints[f.name] for f in fields(section_cls)}


INT_OR_AUTO = int | str  # the type of a key that takes a whole number or "auto"


def type_name(typ) -> str:
    return "int or auto" if typ == INT_OR_AUTO else typ.__name__


def _coerce(key: str, value, typ: type, from_cli: bool):
    """Check (file) or parse (CLI string) one value; UserError naming the key when it does not fit."""
    if typ == INT_OR_AUTO:
        if value == "auto" or (
            key == "dist.nnodes" and isinstance(value, str) and not value.strip().isdigit()
        ):
            return (
                value  # dist.nnodes = MIN:MAX (elastic): checked by DistConfig.check (sections.py)
            )
        if from_cli:
            try:
                return _coerce(key, value, int, from_cli)
            except UserError:
                raise UserError(
                    f"--{key}={value!r} is not a whole number or auto, e.g. --{key}=16 or --{key}=auto"
                ) from None
        if type(value) is not int:
            raise UserError(
                f'{key} = {value!r} in the config file must be a whole number or "auto", e.g. {key.rpartition(".")[2]} = 16 or "auto"'
            )
        return value
    if from_cli:
        text = value
        try:
            if typ is bool:
                if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return text.lower() in ("true", "1", "yes")
            if typ is int:
                number = float(text)  # accepts 524288 and 2**19 written as 5.24288e5
                if not number.is_integer():
                    raise ValueError
                return int(number)
            if typ is float:
                return float(text)
            return text
        except ValueError:
            raise UserError(f"--{key}={text!r} is not a valid {typ.__name__}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not typ:
        raise UserError(
            f"{key} = {value!r} in the config file is a {type(value).__name__}; expected {typ.__name__}"
        )
    return value


def _apply(values: dict[str, dict], key: str, raw, from_cli: bool) -> None:
    section, _, name = key.partition(".")
    if section not in SECTIONS or not name:
        raise UserError(f"unknown config section in {key!r}; sections are: {', '.join(SECTIONS)}")
    types = field_types(type(SECTIONS[section]()))
    if section == "train" and name in MOVED_TO_OPTIM:
        raise UserError(f"{key} moved to the [optim] section: use optim.{name}")
    if name not in types:
        raise UserError(f"unknown config key {key!r}; keys of [{section}]: {', '.join(types)}")
    field_name = name + "_" if keyword.iskeyword(name) else name
    values[section][field_name] = _coerce(key, raw, types[name], from_cli)


def load_config(config_file: str | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults, then the TOML file, then `section.key=value` overrides; validated."""
    text = None
    if config_file:
        try:
            text = Path(config_file).read_text()
        except FileNotFoundError:
            raise UserError(
                f"config file {config_file} not found; presets are in configs/ (e.g. configs/debug.toml)"
            ) from None
        except OSError as e:
            raise UserError(f"cannot read config file {config_file}: {e}") from None
    return load_config_text(text, config_file, overrides)


def load_config_text(
    text: str | None, source: str | None = None, overrides: list[str] | tuple = ()
) -> Config:
    """load_config of a TOML text (`source` names it in errors)."""
    values: dict[str, dict] = {s: {} for s in SECTIONS}
    if text is not None:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"cannot read config file {source}: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise UserError(
                    f"{source}: top-level key {section!r} must be a [section]; sections are: {', '.join(SECTIONS)}"
                )
            for name, raw in table.items():
                _apply(values, f"{section}.{name}", raw, from_cli=False)
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq:
            raise UserError(
                f"override {item!r} needs the form section.key=value, e.g. optim.lr=1e-3"
            )
        _apply(values, key.strip(), raw.strip(), from_cli=True)
    init_from_arch(values["model"])
    cfg = Config(**{s: type(SECTIONS[s]())(**values[s]) for s in SECTIONS})
    cfg.check()  # sections.py: values wrong on their own (each section) or together (Config)
    check_arch_keys(cfg.model.arch, values["model"])
    return cfg


def folder_arch(folder: str) -> str | None:
    """The block (gpt2 or nanochat) of a model.init_from folder: its config.json's model_type
    (absent: gpt2, as gptrain/model/hf.py load_hf_folder reads it); None when the file cannot be
    read or names another model (the build then refuses the folder in one line)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    arch = raw.get("model_type", "gpt2") if isinstance(raw, dict) else None
    return arch if arch in ARCHS else None


def init_from_arch(given: dict) -> None:
    """model.init_from: the folder's config.json sets the architecture, so model.arch (the [model]
    keys set in the file or on the command line: `given`, updated in place) becomes the folder's
    block where it is not set, and is refused where it is set to the other block."""
    folder = given.get("init_from")
    arch = folder_arch(folder) if folder else None
    if arch is None:
        return
    check_arch_of_folder(given.setdefault("arch", arch), arch, folder)


def check_arch_of_folder(arch: str, found: str, folder: str) -> None:
    """A UserError where model.arch names another block than the init_from folder holds."""
    name = {"gpt2": "GPT-2", "nanochat": "NanoChat"}[found]
    check(
        arch == found,
        f"model.arch = {arch!r} but model.init_from = {folder!r} holds a {name} model (config.json model_type {found!r}); drop model.arch (the folder sets it) or set --model.arch={found}",
    )


def other_arch_keys(arch: str) -> tuple[str, ...]:
    """The [model] keys that the other block has and `arch` has not."""
    return NANOCHAT_ONLY if arch == "gpt2" else GPT2_ONLY


def check_arch_keys(arch: str, given: dict) -> None:
    """A key of the other block, set in the file or on the command line (`given`: the [model]
    keys set there; a default is never a refusal), is refused."""
    for key in other_arch_keys(arch):
        check(
            key not in given,
            f"model.{key} is a setting of the {'nanochat' if arch == 'gpt2' else 'gpt2'} block, but model.arch = {arch!r}; drop model.{key} or set model.arch",
        )


def resolved_again(text: str) -> str | None:
    """A resolved config's text (to_toml's, perhaps written by an older gptrain) as this version
    resolves it: keys added since take their defaults. None when it no longer loads."""
    try:
        return to_toml(load_config_text(text, "the saved config"))
    except UserError:
        return None


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (saved as run.dir/config.toml; loadable with --config). The
    [model] keys of the other block are left out: they do not apply, and loading them back would
    refuse them (check_arch_keys)."""

    def fmt(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):  # JSON's escapes are a TOML basic string's: a newline loads back
            return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
        return repr(v)

    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        items = dataclasses.asdict(getattr(cfg, section)).items()
        skip = other_arch_keys(cfg.model.arch) if section == "model" else ()
        lines += [f"{key_name(k)} = {fmt(v)}" for k, v in items if k not in skip]
        lines.append("")
    return "\n".join(lines)
