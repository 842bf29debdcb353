"""A checkpoint is data that names only its own files: DCP's `.metadata` index is read by an
unpickler that builds exactly the classes an index is made of (not any class of the modules they
live in), its storage paths must be file names of the folder, and the `latest` pointer must name
a checkpoint folder of its directory. Each refusal is one line (exit 2) and reads nothing."""

import pickle
import shutil
import warnings

import pytest
import torch

from gptrain.__main__ import main as cli
from gptrain.checkpoint import dcp as sharded
from gptrain.checkpoint import folder
from gptrain.errors import UserError


@pytest.fixture
def index(tmp_path):
    """A genuine DCP checkpoint folder (two tensors, one of them an optimizer moment)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(3, 4)}, "optim": {"w": {"exp_avg": torch.zeros(3, 4)}}}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "ck"), no_dist=True)
    return tmp_path / "ck"


def naming(module: str, name: str) -> bytes:
    """A pickle that calls module.name("x") (protocol 0: the name is spelled out)."""
    return f"c{module}\n{name}\n(S'x'\ntR.".encode()


def test_a_genuine_index_loads(index):
    metadata = sharded._read_index(index)
    assert set(metadata.state_dict_metadata) == {"model.w", "optim.w.exp_avg"}
    paths = {info.relative_path for info in metadata.storage_data.values()}
    assert paths == {"__0_0.distcp"}


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch.distributed.checkpoint.filesystem", "FileSystemWriter"),
        ("torch.distributed.checkpoint.filesystem", "Path"),  # pathlib.Path, imported there
        ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
        ("torch.distributed.checkpoint.metadata", "Enum"),  # imported there too
        ("pathlib", "Path"),
        ("torch", "Tensor"),
        ("torch", "load"),
        ("torch.futures", "Future"),
        ("os", "mkdir"),
    ],
)
def test_an_index_naming_anything_else_is_refused(index, module, name):
    (index / ".metadata").write_bytes(naming(module, name))
    with pytest.raises(UserError, match=f"refused .*{module}.{name} is not part of a DCP index"):
        sharded._read_index(index)


@pytest.mark.parametrize("where", ["/etc/passwd", "../outside.distcp", "sub/__0_0.distcp", ".."])
def test_storage_paths_outside_the_folder_are_refused(index, where):
    with open(index / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = where
    (index / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError) as e:
        sharded._read_index(index)
    assert f"it names the storage file {where!r}" in str(e.value) and "\n" not in str(e.value)


def test_latest_must_name_a_checkpoint_folder_of_its_directory(tmp_path, capsys):
    """A `latest` that names a path outside checkpoints/ (here a complete-looking folder beside
    the run) is refused by every reader, not followed."""
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    (outside / "meta.json").write_text("{}")
    (outside / "model.safetensors").write_bytes(b"")
    (run_dir / "checkpoints").mkdir(parents=True)
    for name in ("../../outside", str(outside), "step_1/../../../outside"):
        (run_dir / "checkpoints" / "latest").write_text(name + "\n")
        with pytest.raises(UserError, match="which is not a checkpoint folder of this directory"):
            folder.latest(run_dir)
        capsys.readouterr()
        assert cli(["sample", "--run", str(run_dir), "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not a checkpoint folder" in err[0], err
    shutil.rmtree(outside)
