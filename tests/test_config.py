"""Config: precedence CLI > file > defaults, every error names the key, derived accumulation."""

import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from gptrain.__main__ import main as cli
from gptrain.config.cli import help_text
from gptrain.config.load import Config, load_config, to_toml
from gptrain.config.sections import (
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
from gptrain.training.batch import accumulation_steps

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_defaults_file_then_cli_precedence(tmp_path):
    assert load_config().optim.lr == Config().optim.lr
    f = write(tmp_path, "[optim]\nlr = 0.5\n[train]\nseq_len = 32\n[model]\nn_layer = 3\n")
    cfg = load_config(f)
    assert (cfg.optim.lr, cfg.train.seq_len, cfg.model.n_layer) == (0.5, 32, 3)
    cfg = load_config(f, ["optim.lr=0.25", "model.n_layer=5", "train.compile=true"])
    assert (cfg.optim.lr, cfg.train.seq_len, cfg.model.n_layer, cfg.train.compile) == (
        0.25,
        32,
        5,
        True,
    )
    assert (
        cfg.train.micro_batch_size == Config().train.micro_batch_size
    )  # untouched key keeps its default


def test_int_in_file_accepted_for_float_and_sci_notation_on_cli(tmp_path):
    cfg = load_config(write(tmp_path, "[optim]\nlr = 1\n"), ["train.total_batch_size=5.24288e5"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.train.total_batch_size == 524288


@pytest.mark.parametrize(
    "text, overrides, needle",
    [
        ("[train]\nlrr = 1.0\n", [], "train.lrr"),
        ("[trian]\nlr = 1.0\n", [], "trian"),
        ("[optim]\nlr = 'fast'\n", [], "optim.lr"),
        ("[train]\nlr = 1e-3\n", [], "moved to the [optim] section: use optim.lr"),
        ("", ["optim.name=sgd"], "optim.name"),
        ("", ["optim.lr_schedule=linear"], "optim.lr_schedule"),
        ("", ["optim.decay_fraction=0"], "optim.decay_fraction"),
        ("", ["optim.decay_fraction=1.5"], "optim.decay_fraction"),
        ("[train]\ncompile = 1\n", [], "train.compile"),
        ("", ["train.max_steps=ten"], "--train.max_steps='ten'"),
        ("", ["train.max_steps=1.5"], "train.max_steps"),
        ("", ["train.compile=maybe"], "train.compile"),
        ("", ["train.dtype=float64"], "train.dtype"),
        ("", ["train.attention=flash"], "train.attention"),
        ("", ["model.gelu=relu"], "model.gelu"),
        ("", ["optim.min_lr=1", "optim.lr=0.1"], "optim.min_lr"),
        ("", ["model.n_embd=100", "model.n_head=3"], "model.n_embd"),
        ("", ["optim.warmup_steps=500", "train.max_steps=100"], "optim.warmup_steps"),
        ("", ["dist.mode=tp"], "dist.mode"),
        ("", ["dist.nproc_per_node=many"], "dist.nproc_per_node"),
        ("", ["checkpoint.resume=yesterday"], "checkpoint.resume"),
        ("", ["optim.lr"], "section.key=value"),
        ("", ["model.block_size=16", "train.seq_len=64"], "model.block_size"),
    ],
)
def test_errors_name_the_key(tmp_path, text, overrides, needle):
    with pytest.raises(UserError) as e:
        load_config(write(tmp_path, text) if text else None, overrides)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "section, bad, needle",
    [
        (ModelConfig, {"dropout": 1.0}, "model.dropout"),
        (DataConfig, {"stride": -1}, "data.stride"),
        (TrainConfig, {"max_steps": 0}, "train.max_steps"),
        (TrainConfig, {"spike_window": 1}, "train.spike_window"),
        (OptimConfig, {"beta2": 1.0}, "optim.beta2"),
        (OptimConfig, {"warmup_steps": -1}, "optim.warmup_steps"),
        (EvalConfig, {"every": -1}, "eval.every"),
        (CheckpointConfig, {"keep_last": 0}, "checkpoint.keep_last"),
        (LogConfig, {"every": 0}, "log.every"),
        (DistConfig, {"nnodes": "2:1"}, "dist.nnodes"),
        (DistConfig, {"nnodes": 2}, "dist.rdzv_endpoint"),
        (DistConfig, {"rdzv_conf": "last_call=5"}, "dist.rdzv_conf"),
        (DistConfig, {"rdzv_conf": "join_timeout=0"}, "dist.rdzv_conf"),
        (RunConfig, {"max_failed_attempts": -1}, "run.max_failed_attempts"),
    ],
)
def test_each_section_checks_its_own_values(section, bad, needle):
    """Validation sits beside each section: its check() refuses its own bad values without the
    rest of the config, and the defaults pass; Config.check() (load_config) runs it."""
    section().check()
    with pytest.raises(UserError, match=needle.replace(".", r"\.")) as e:
        section(**bad).check()
    assert "\n" not in str(e.value)
    (key, value), name = next(iter(bad.items())), needle.partition(".")[0]
    with pytest.raises(UserError, match=needle.replace(".", r"\.")):
        load_config(None, [f"{name}.{key}={value}"])


def test_model_arch_choices_are_the_models():
    """model.arch's choices are the blocks gptrain/model/arch.py builds."""
    from dataclasses import fields

    from gptrain.model.arch import ARCHS

    arch = next(f for f in fields(ModelConfig) if f.name == "arch")
    assert arch.metadata["choices"] == ARCHS and ModelConfig().arch == "gpt2"


def test_nanochat_keys_load_and_round_trip(tmp_path):
    """A plain --model.arch=nanochat loads (the gpt2-only keys' defaults are no refusal); its
    own keys are set, and the resolved config, which leaves the other block's keys out, loads
    back equal (also as a gpt2 config)."""
    cfg = load_config(None, ["model.arch=nanochat"])
    assert (cfg.model.n_kv_head, cfg.model.mlp_hidden, cfg.model.softcap) == (0, 0, 15.0)
    args = ["model.arch=nanochat", "model.n_kv_head=2", "model.mlp_hidden=96", "model.softcap=0"]
    cfg = load_config(None, args)
    assert (cfg.model.n_kv_head, cfg.model.mlp_hidden, cfg.model.softcap) == (2, 96, 0.0)
    for c in (cfg, load_config()):
        text = to_toml(c)
        model = tomllib.loads(text)["model"]
        assert ("softcap" in model) == (c.model.arch == "nanochat") != ("gelu" in model)
        assert load_config(write(tmp_path, text)) == c


@pytest.mark.parametrize(
    "text, overrides, needle",
    [
        ("", ["model.arch=nanochat", "model.bias=true"], "model.bias is a setting of the gpt2"),
        ("[model]\narch = 'nanochat'\ngelu = 'erf'\n", [], "model.gelu is a setting of the gpt2"),
        ("", ["model.softcap=10"], "model.softcap is a setting of the nanochat"),
        ("[model]\nn_kv_head = 2\n", [], "model.n_kv_head is a setting of the nanochat"),
        ("", ["model.mlp_hidden=64"], "model.mlp_hidden is a setting of the nanochat"),
        ("", ["model.arch=nanochat", "model.n_embd=96", "model.n_head=32"], "is odd"),
        ("", ["model.arch=nanochat", "model.n_kv_head=3"], "model.n_kv_head = 3 does not divide"),
        ("", ["model.arch=nanochat", "model.softcap=-1"], "model.softcap = -1.0 must be >= 0"),
        ("", ["model.arch=nanochat", "model.preset=gpt2"], "model.preset = 'gpt2' names a GPT-2"),
        ("", ["model.arch=llama"], "model.arch = 'llama'; allowed: gpt2, nanochat"),
    ],
)
def test_model_arch_refusals_are_one_line_exit_2(tmp_path, capsys, text, overrides, needle):
    """A key of the other block set explicitly, an odd head size, n_kv_head not dividing n_head,
    a negative softcap, a GPT-2 preset with nanochat: one line naming the key, exit 2, no run
    folder."""
    with pytest.raises(UserError) as e:
        load_config(write(tmp_path, text) if text else None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)
    run = tmp_path / "run"
    file = ["--config", write(tmp_path, text)] if text else []
    assert cli(["train", *file, f"--run.dir={run}", *(f"--{o}" for o in overrides)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and not run.exists()


def test_cross_section_checks_belong_to_config():
    """A value that is wrong only together with another section's passes its own section's check
    and is refused by Config.check() with both keys named."""
    OptimConfig(warmup_steps=500).check()
    TrainConfig(max_steps=100).check()
    cfg = Config(optim=OptimConfig(warmup_steps=500), train=TrainConfig(max_steps=100))
    with pytest.raises(UserError, match=r"optim\.warmup_steps.*train\.max_steps"):
        cfg.check()
    with pytest.raises(
        UserError, match=r"optim\.muon_split = 'redundant' with dist\.mode = 'fsdp'"
    ):
        muon = OptimConfig(name="muon", muon_split="redundant")
        Config(optim=muon, dist=DistConfig(mode="fsdp")).check()


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(str(tmp_path / "nope.toml"))
    with pytest.raises(UserError, match="cannot read config file"):
        load_config(write(tmp_path, "[train\n"))


def test_accumulation_derived_and_error_has_all_numbers():
    assert accumulation_steps(524288, 64, 1024, 8) == 1
    assert accumulation_steps(524288, 16, 1024, 8) == 4
    assert accumulation_steps(1024, 8, 64, 1) == 2
    with pytest.raises(UserError) as e:
        accumulation_steps(1000, 8, 64, 2)
    msg = str(e.value)
    for n in ("1000", "8", "64", "(2)", "1024"):
        assert n in msg


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(
        None, ["optim.lr=0.01", 'eval.sample_prompt=ROMEO:\\n "quoted"', "run.dir=/tmp/x"]
    )
    text = to_toml(cfg)
    tomllib.loads(text)  # valid TOML
    assert load_config(write(tmp_path, text)) == cfg


def test_presets_load_and_help_documents_every_key():
    for preset in sorted((REPO / "configs").glob("*.toml")):
        load_config(str(preset))
    nanochat = load_config(str(REPO / "configs" / "nanochat_124m.toml")).model
    assert (nanochat.arch, nanochat.n_layer, nanochat.n_embd, nanochat.n_embd // nanochat.n_head) == ("nanochat", 12, 768, 128)  # fmt: skip
    small, twin = (load_config(str(REPO / "configs" / f"{n}.toml")) for n in ("small", "nanochat_small"))  # fmt: skip
    assert (twin.model.arch, twin.model.n_layer, twin.model.n_embd) == ("nanochat", small.model.n_layer, small.model.n_embd)  # fmt: skip
    assert (twin.train, twin.data) == (small.train, small.data)
    big = load_config(str(REPO / "configs" / "nanochat_124m.toml")).optim
    assert (big.name, big.embed_lr, big.head_lr > 0, big.warmup_steps) == ("muon", 0.0, True, 0)
    # nanochat's width rule: the AdamW lrs x (n_embd / 768) ** -0.5; the rest as at 768
    scale = (twin.model.n_embd / 768) ** -0.5
    assert (twin.optim.lr, twin.optim.head_lr) == pytest.approx((big.lr * scale, big.head_lr * scale), rel=1e-5)  # fmt: skip
    assert replace(twin.optim, lr=big.lr, head_lr=big.head_lr) == big
    text = help_text()
    assert "--dist.nnodes (int or MIN:MAX, default 1)" in text
    assert "--dist.hang_timeout_s (int or auto, default 'auto')" in text
    for section in ("model", "data", "train", "eval", "checkpoint", "log", "dist", "run"):
        for key in tomllib.loads(to_toml(Config()))[section]:
            assert f"--{section}.{key} " in text
    for key in ("arch", "n_kv_head", "mlp_hidden", "softcap"):
        assert f"--model.{key} " in text


def test_cli_bad_input_is_one_line_exit_2(capsys):
    assert cli(["train", "--train.nonsense=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gptrain: error:") and "train.nonsense" in err and "\n" not in err
    assert cli(["train", "stray"]) == 2
    assert cli(["frobnicate"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_cli_forms_of_overrides():
    from gptrain.config.cli import parse_cli

    argv = ["--config", "c.toml", "--optim.lr=0.1", "--train.seq_len", "32", "--train.compile", "--log.every", "-1"]  # fmt: skip
    assert parse_cli(argv) == ("c.toml", ["optim.lr=0.1", "train.seq_len=32", "train.compile=true", "log.every=-1"])  # fmt: skip
    with pytest.raises(UserError, match="unexpected argument 'stray'"):
        parse_cli(["stray"])


def test_checkpoint_async_key_and_its_refusals(tmp_path, capsys, monkeypatch):
    """checkpoint.async (a Python keyword: field async_) round-trips through TOML and --help; it is
    refused with one line where the run writes full checkpoints (ddp; one process under fsdp)
    and where torch has no DCP async_save, before anything is written."""
    import torch.distributed.checkpoint as dcp

    cfg = load_config(None, ["checkpoint.async=true", "dist.mode=fsdp"])
    assert cfg.checkpoint.async_ is True
    assert load_config(write(tmp_path, to_toml(cfg))) == cfg
    assert "--checkpoint.async (bool, default False)" in help_text()
    run = tmp_path / "run"
    for extra in (["--dist.mode=ddp"], ["--dist.mode=fsdp"]):
        assert cli(["train", f"--run.dir={run}", "--checkpoint.async=true", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("gptrain: error: checkpoint.async = true") and "\n" not in err
        assert "checkpoint.async=false" in err and "full checkpoints" in err
    monkeypatch.delattr(dcp, "async_save")
    assert cli(["train", f"--run.dir={run}", "--checkpoint.async=true", "--dist.mode=fsdp"]) == 2
    err = capsys.readouterr().err.strip()
    assert "checkpoint.async = true needs torch.distributed.checkpoint.async_save" in err
    assert "\n" not in err and "checkpoint.async=false" in err
    assert not run.exists()


def test_every_key_has_help_of_at_most_200_characters():
    """`--help` is a reference line per key (meaning, unit, allowed values): every field of every
    section dataclass has help text, none longer than 200 characters (reasons and measurements
    belong in docs/configs.md)."""
    import dataclasses
    import inspect

    from gptrain.config import sections

    classes = {cls for _, cls in inspect.getmembers(sections, dataclasses.is_dataclass)}
    assert {f.default_factory for f in dataclasses.fields(Config)} <= classes
    too_long, missing = [], []
    for cls in classes:
        for f in dataclasses.fields(cls):
            text = f.metadata.get("help")
            if not isinstance(text, str) or not text.strip():
                missing.append(f"{cls.__name__}.{f.name}")
            elif len(text) > 200:
                too_long.append(f"{cls.__name__}.{f.name} ({len(text)})")
    assert not missing, f"fields without help: {missing}"
    assert not too_long, f"help over 200 characters: {too_long}"


def test_muon_weight_decay_is_its_own_key():
    """optim.muon_weight_decay is set on its own, leaving optim.weight_decay at its default; a
    negative value of either is refused in one line naming the key."""
    o = load_config(None, ["optim.name=muon", "optim.muon_weight_decay=0.25"]).optim
    assert (o.muon_weight_decay, o.weight_decay) == (0.25, OptimConfig().weight_decay)
    assert "--optim.muon_weight_decay (float, default 0.1)" in help_text()
    for key in ("weight_decay", "muon_weight_decay"):
        with pytest.raises(UserError, match=rf"optim\.{key} = -0\.1 must be >= 0") as e:
            load_config(None, [f"optim.{key}=-0.1"])
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.beta2=1", "optim.beta2 = 1.0 must be in (0, 1), e.g. --optim.beta2=0.95"),
        ("optim.beta2=0", "optim.beta2 = 0.0 must be in (0, 1), e.g. --optim.beta2=0.95"),
        ("optim.beta2=nan", "optim.beta2 = nan must be in (0, 1), e.g. --optim.beta2=0.95"),
        ("optim.beta1=1.5", "optim.beta1 = 1.5 must be in [0, 1), e.g. --optim.beta1=0.9"),
        ("optim.beta1=-0.1", "optim.beta1 = -0.1 must be in [0, 1), e.g. --optim.beta1=0.9"),
        ("optim.embed_lr=-1e-3", "optim.embed_lr = -0.001 must be >= 0 (0: optim.lr)"),
        (
            "optim.head_lr=-1e-3",
            "optim.head_lr = -0.001 must be >= 0 (0: the embeddings' lr, optim.embed_lr or optim.lr)",
        ),  # fmt: skip
    ],
)
def test_bad_betas_and_embed_lr_are_one_line_exit_2(tmp_path, capsys, override, needle):
    """beta2 outside (0, 1) (0 would make AdamW's step sign(g) x lr), beta1 outside [0, 1) (0: no
    momentum) and a negative embed lr: one line naming the key and a value to use, exit 2,
    no run folder; the edges that are allowed load."""
    run = tmp_path / "run"
    assert cli(["train", f"--run.dir={run}", f"--{override}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"gptrain: error: {needle}" and not run.exists()
    o = load_config(None, ["optim.beta1=0", "optim.beta2=0.9999", "optim.embed_lr=0"]).optim
    assert (o.beta1, o.beta2, o.embed_lr) == (0.0, 0.9999, 0.0)


def test_embed_lr_is_its_own_key_beside_lr():
    """optim.embed_lr is set alone (lr keeps its default), in both optimizer modes, round-trips
    through the resolved config, and --help says which parameters it moves."""
    for name in ("adamw", "muon"):
        o = load_config(None, [f"optim.name={name}", "optim.embed_lr=3e-3"]).optim
        assert (o.embed_lr, o.lr) == (3e-3, OptimConfig().lr)
    cfg = load_config(None, ["optim.embed_lr=3e-3"])
    assert tomllib.loads(to_toml(cfg))["optim"]["embed_lr"] == 3e-3
    text = help_text()
    assert "--optim.embed_lr (float, default 0.0)" in text
    assert "embeddings and the output head" in text.split("--optim.embed_lr")[1].split("--")[0]


def test_head_lr_is_its_own_key_beside_embed_lr():
    """optim.head_lr is set alone (lr and embed_lr keep their defaults), round-trips through the
    resolved config, and --help says it is the untied head's lr."""
    o = load_config(None, ["optim.name=muon", "optim.head_lr=4e-3"]).optim
    assert (o.head_lr, o.embed_lr, o.lr) == (4e-3, 0.0, OptimConfig().lr)
    cfg = load_config(None, ["optim.head_lr=4e-3"])
    assert tomllib.loads(to_toml(cfg))["optim"]["head_lr"] == 4e-3
    text = help_text()
    assert "--optim.head_lr (float, default 0.0)" in text
    assert "untied output head" in text.split("--optim.head_lr")[1].split("--")[0]
