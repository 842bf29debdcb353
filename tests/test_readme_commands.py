"""Every training command the README and the guides in docs/ (and the presets' and
gptrain/commands/train.py's headers) show is valid for the world size it shows: its config loads and
its global batch divides into micro-batches. The same checks run over README.md and every docs/*.md.

World size = processes per node x nodes, read from the command (torchrun's --nproc_per_node /
--nnodes, or gptrain's --dist.nproc_per_node / --dist.nnodes; a Slurm script's node count from
its `#SBATCH --nodes`). `auto` processes per node is taken as 8 GPUs, the usual GPU node.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from gptrain.config.load import load_config
from gptrain.training import batch

REPO = Path(__file__).resolve().parents[1]
GPUS_PER_NODE_FOR_AUTO = 8


def _code_blocks(text: str) -> list[str]:
    """Fenced blocks of a markdown file; for other files, the whole text (comments included)."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    return blocks or [text]


def training_commands(path: Path) -> list[tuple[str, list[str], dict]]:
    """(the command as written, its arguments after `train`, variables such as SLURM_NNODES)."""
    found = []
    for block in _code_blocks(path.read_text()):
        env = {}
        nodes = re.search(r"#SBATCH[^\n]*--nodes=(\d+)", block)
        if nodes:
            env["SLURM_NNODES"] = nodes.group(1)
        joined = re.sub(r"\\+\n\s*", " ", block)  # line continuations
        for line in joined.splitlines():
            line = line.split("  #")[0].strip().lstrip("#").strip()  # trailing / leading comments
            if not re.search(r"(^|\s)(gptrain|-m gptrain) train(\s|$)", line):
                continue
            if "--help" in line:
                continue
            found.append((line, shlex.split(line), env))
    return found


def world_size(argv: list[str], env: dict) -> tuple[list[int], str | None, list[str]]:
    """(world size, config file, gptrain overrides) of one command line."""
    nproc, nnodes, config, overrides = "1", "1", None, []
    train_at = argv.index("train")
    launcher, args = argv[:train_at], argv[train_at + 1 :]
    for a in launcher:  # torchrun's own flags
        if a.startswith("--nproc_per_node="):
            nproc = a.split("=", 1)[1]
        if a.startswith("--nnodes="):
            nnodes = a.split("=", 1)[1]
    i = 0
    while i < len(args):
        if args[i] == "--config":
            config, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--") and "=" in args[i]:
            overrides.append(args[i][2:])
        i += 1
    under_torchrun = any("torchrun" in a for a in launcher)
    if not under_torchrun:  # gptrain launches the workers itself
        for o in overrides:
            if o.startswith("dist.nproc_per_node="):
                nproc = o.split("=", 1)[1]
            if o.startswith("dist.nnodes="):
                nnodes = o.split("=", 1)[1]
    nnodes = env.get(nnodes.removeprefix("$"), nnodes)
    nproc = GPUS_PER_NODE_FOR_AUTO if nproc == "auto" else int(nproc)
    low, _, high = str(nnodes).partition(":")  # elastic MIN:MAX: every node count in between
    return [nproc * n for n in range(int(low), int(high or low) + 1)], config, overrides


DOCS = sorted((REPO / "docs").glob("*.md"))
SOURCES = [
    REPO / "README.md",
    *DOCS,
    REPO / "gptrain" / "commands" / "train.py",
    *sorted((REPO / "configs").glob("*.toml")),
]
COMMANDS = [(p, *c) for p in SOURCES for c in training_commands(p)]


def test_the_readme_shows_the_commands_this_test_checks():
    readme = [c for c in COMMANDS if c[0].name == "README.md"]
    worlds = {w for _, _, argv, env in readme for w in world_size(argv, env)[0]}
    assert len(readme) >= 8 and {1, 8, 16, 32} <= worlds, worlds  # laptop, 8 GPUs, 2 and 4 nodes


def test_the_docs_show_the_commands_this_test_checks():
    """docs/*.md are read (a moved folder would silently check nothing), and the distributed
    guide's commands cover 8 GPUs, 2 nodes and a 4-node Slurm job."""
    assert REPO / "docs" / "distributed.md" in DOCS, DOCS
    guide = [c for c in COMMANDS if c[0].name == "distributed.md"]
    worlds = {w for _, _, argv, env in guide for w in world_size(argv, env)[0]}
    assert len(guide) >= 6 and {8, 16, 32} <= worlds, worlds


@pytest.mark.parametrize(
    "source, line, argv, env", COMMANDS, ids=[f"{c[0].name}:{c[1][:60]}" for c in COMMANDS]
)
def test_command_is_valid_for_its_world_size(source, line, argv, env, monkeypatch):
    monkeypatch.chdir(REPO)  # config paths are relative to the checkout
    worlds, config, overrides = world_size(argv, env)
    cfg = load_config(config, overrides)  # a UserError (bad key or value) fails the test
    for world in worlds:  # a batch that does not divide fails the test
        mb, accum = batch.plan(cfg.train, world)
        t = cfg.train
        assert mb * t.seq_len * world * accum == t.total_batch_size, (line, world)
