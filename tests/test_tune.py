"""benchmarks/study/tune.py's search with a fake trial (a bowl around a known optimum, no training): every
best ends strictly inside its grid (or at a bound), edges are extended, every arm gets the same
number of trials, and a stopped search resumes to the same trials."""

import json
import math
import subprocess
import sys

import pytest
from train_helpers import REPO

from gptrain.distributed import watchdog

sys.path.insert(0, str(REPO / "benchmarks" / "study"))
import tune  # noqa: E402
from tune import Axis, Search  # noqa: E402

LR = Axis("lr", 4e-3, 2.0)
SHARE = Axis("share", 0.4, 0.2, "lin", 0.1, 1.0)
WD = Axis("wd", 0.1, 0.0, "cat", choices=(0.0, 0.1))


def bowl(optimum: dict[str, float], axes):
    """A loss whose minimum is at `optimum`: squared distance in lattice steps."""

    def loss(point):
        total = 0.0
        for a, v in zip(axes, point, strict=True):
            o = optimum[a.name]
            if a.scale == "log":
                total += math.log2(v / o) ** 2
            elif a.scale == "lin":
                total += ((v - o) / a.step) ** 2
            else:
                total += 0.0 if v == o else 0.5
        return total

    return loss


def run(arms: dict, optima: dict, budget=16, cap=4):
    searches = {name: Search(axes) for name, axes in arms.items()}
    fns = {name: bowl(optima[name], axes) for name, axes in arms.items()}
    counts = tune.tune(searches, lambda arm, p: fns[arm](p), budget, cap)
    return searches, counts


def line(search: Search, i: int) -> list[float]:
    """The values tried on axis i with every other axis at the best's."""
    best = search.best()
    return sorted(p[i] for p in search.order if p[:i] + p[i + 1 :] == best[:i] + best[i + 1 :])


def test_a_best_beyond_the_first_grid_is_reached_and_ends_inside():
    searches, counts = run({"a": (LR, SHARE)}, {"a": {"lr": 0.05, "share": 0.72}})
    s = searches["a"]
    best = dict(zip(("lr", "share"), s.best(), strict=True))
    lrs = line(s, 0)
    assert 0.128 in [round(v, 12) for v in lrs]  # extended 5 doublings up, one past 0.064
    assert lrs[0] < best["lr"] < lrs[-1]  # tried on both sides
    assert abs(math.log2(best["lr"] / 0.05)) < 0.5  # then refined: nearer than 0.064 (0.36)
    assert abs(best["share"] - 0.72) <= 0.08 + 1e-9  # 0.8, the lattice's nearest, or nearer
    assert [s.position(i) for i in range(2)] == ["inside", "inside"]
    assert 16 <= counts["a"] <= 20  # the budget, and at most the cap to leave an edge


def test_an_optimum_past_a_bound_is_at_the_bound_not_an_edge():
    searches, _ = run({"a": (LR, SHARE, WD)}, {"a": {"lr": 4e-3, "share": 0.0, "wd": 0.0}})
    s = searches["a"]
    assert s.best()[1] == 0.1 and s.best()[2] == 0.0  # share's lowest allowed value, 0.4 - 0.3
    assert [s.position(i) for i in range(3)] == ["inside", "bound", "inside"]
    assert not s.at_edge()


def test_every_arm_ends_with_the_same_number_of_trials():
    """A far optimum needs trials past the budget (up to the cap); the other arms are then brought
    to the same count by the same rule, although their search converged early."""
    arms = {"far": (LR, SHARE), "near": (LR, SHARE, WD), "two": (LR, SHARE)}
    optima = {
        "far": {"lr": 4e-3 * 2**14, "share": 0.4},  # 14 doublings away
        "near": {"lr": 4e-3, "share": 0.4, "wd": 0.1},
        "two": {"lr": 5e-3, "share": 0.5},
    }
    searches, counts = run(arms, optima, budget=12, cap=4)
    assert counts == {"far": 16, "near": 16, "two": 16}
    assert searches["far"].at_edge()  # still at its edge after the cap: the table says so
    assert searches["far"].position(0) == "edge"
    assert not searches["near"].at_edge() and not searches["two"].at_edge()
    # the converged arms spent their extra trials refining around their best
    two = searches["two"]
    assert len(set(two.order)) == 16 and two.position(0) == "inside"


def test_a_best_moved_to_an_edge_while_levelling_is_filled_and_levelled_again():
    """Bringing the arms level can move an arm's best to a point at an edge; that arm then fills
    again and the others are brought level again: every arm ends inside, with equal counts."""
    arms = {"a": (LR, SHARE), "c": (LR, SHARE, WD)}
    optima = {"a": {"lr": 0.0183, "share": 0.334}, "c": {"lr": 0.0049, "share": 0.113, "wd": 0.1}}
    searches, counts = run(arms, optima, budget=8, cap=12)
    assert counts["a"] == counts["c"] > 10  # levelling at 10 left "a" at an edge: it filled on
    assert not any(s.at_edge() for s in searches.values())


def test_an_edge_is_extended_before_anything_is_refined():
    s = Search((LR, SHARE))
    loss = bowl({"lr": 4e-3 / 8, "share": 0.4}, s.axes)
    for _ in range(6):
        point = s.propose()
        s.record(point, loss(point))
    # the center, then one step past each new lower edge until the best is inside; no midpoint
    assert [p[0] for p in s.order[:5]] == pytest.approx([4e-3 / 2**k for k in range(5)])
    assert s.order[5] == (4e-3 / 8, 0.2)  # then the next axis, at the best's lr


def test_a_stopped_search_resumes_to_the_same_trials():
    """The search is a function of the results: rerun with the finished trials read back (as
    run directories are), it proposes the same points and trains only the missing ones."""
    arms = {"a": (LR, SHARE, WD), "b": (LR,)}
    optima = {"a": {"lr": 0.02, "share": 0.8, "wd": 0.0}, "b": {"lr": 1e-3}}
    fns = {name: bowl(optima[name], axes) for name, axes in arms.items()}
    done, trained = {}, []

    class Stop(Exception):
        pass

    def trial(arm, point, stop_after=None):
        if (arm, point) not in done:
            if stop_after is not None and len(trained) >= stop_after:
                raise Stop
            trained.append((arm, point))
            done[arm, point] = fns[arm](point)
        return done[arm, point]

    with pytest.raises(Stop):
        tune.tune({n: Search(a) for n, a in arms.items()}, lambda a, p: trial(a, p, 9), 10, 2)
    assert len(trained) == 9
    resumed = {n: Search(a) for n, a in arms.items()}
    tune.tune(resumed, trial, 10, 2)
    whole, _ = run(arms, optima, budget=10, cap=2)
    assert {n: s.order for n, s in resumed.items()} == {n: s.order for n, s in whole.items()}
    assert len(trained) == sum(len(s.order) for s in whole.values())  # none trained twice


def test_arms_side_by_side_try_the_same_points_as_one_at_a_time():
    """--jobs 2: the arms' searches run in threads, their trials interleaved (a trial of one arm
    waits while the other's finish), and still each arm tries the points it tries alone."""
    import threading
    import time

    arms = {"a": (LR, SHARE, WD), "b": (LR,), "c": (LR, SHARE)}
    optima = {"a": {"lr": 0.02, "share": 0.8, "wd": 0.0}, "b": {"lr": 1e-3}}
    optima["c"] = {"lr": 0.1, "share": 0.4}
    fns = {name: bowl(optima[name], axes) for name, axes in arms.items()}
    alive, most = set(), []

    def trial(arm, point):
        alive.add(threading.get_ident())
        most.append(len(alive))
        time.sleep(0.002 if arm == "a" else 0.001)
        alive.discard(threading.get_ident())
        return fns[arm](point)

    side = {n: Search(a) for n, a in arms.items()}
    counts = tune.tune(side, trial, 10, 2, jobs=2)
    alone, alone_counts = run(arms, optima, budget=10, cap=2)
    assert max(most) == 2  # two arms' trials did run at once
    assert counts == alone_counts
    assert {n: s.order for n, s in side.items()} == {n: s.order for n, s in alone.items()}


def test_a_finished_trial_is_read_not_trained(tmp_path, monkeypatch):
    run_dir = tmp_path / "baseline" / "lr=0.004"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"val_loss": 1.25}))
    monkeypatch.setattr(tune.subprocess, "run", lambda *a, **k: pytest.fail("trained again"))
    assert tune.train_trial(tune.ARMS["baseline"], run_dir, []) == 1.25


def test_shares_become_steps_and_ratios_become_min_lr():
    arm = tune.ARMS["baseline"]
    point = {"lr": 2e-3, "warmup_share": 0.05, "weight_decay": 0.0, "final_lr_ratio": 0.1}
    assert arm.overrides(point, 500) == [
        "optim.lr=0.002",
        "optim.warmup_steps=25",
        "optim.weight_decay=0",
        "optim.min_lr=0.0002",
    ]


def test_other_overrides_in_the_same_folder_are_refused(tmp_path):
    tune.check_plan(tmp_path, {"configs": {"a": "x"}, "overrides": ["train.max_steps=10"]})
    tune.check_plan(tmp_path, {"configs": {"a": "x"}, "overrides": ["train.max_steps=10"]})
    with pytest.raises(tune.UserError, match="other configs or overrides"):
        tune.check_plan(tmp_path, {"configs": {"a": "x"}, "overrides": ["train.max_steps=20"]})


@pytest.mark.parametrize("name", sorted(tune.ARMS))
def test_each_arm_starts_at_its_config(name):
    """The search's first point is the arm's preset: applying it changes nothing. The ablation's
    warmup share starts at its config's 2 steps at the tuning cell's length (its shares elsewhere
    scale with the steps), so it is read there."""
    from study_cells import tune_cell

    from gptrain.config.load import load_config

    arm = tune.ARMS[name]
    steps = [f"train.max_steps={tune_cell('code').steps}"] if name == "ablation" else []
    cfg = load_config(str(REPO / arm.config), steps)
    center = {a.name: a.center for a in arm.axes}
    assert load_config(str(REPO / arm.config), steps + arm.overrides(center, cfg.train.max_steps)) == cfg  # fmt: skip
    if name == "ablation":
        assert cfg.optim.warmup_steps == 2


def test_the_baselines_freedoms_are_axes_of_both_adamw_arms():
    """beta2 takes 0.95 and the value keeping 0.95's half-life in tokens at 2^19-token steps at
    the study's batch (computed here from the half-life); the embeddings' lr is a factor of lr
    by powers of 2, optim.embed_lr = factor x lr (1: 0, which means lr); the ablation searches
    its warmup share and the embeddings' lr too (the recipe's AdamW lr is theirs alone)."""
    from gptrain.config.load import load_config

    batch = load_config(str(REPO / "configs/study_baseline.toml")).train.total_batch_size
    half_life_tokens = math.log(0.5) / math.log(0.95) * 2**19
    kept = 0.5 ** (batch / half_life_tokens)
    for name in ("baseline", "nanochat_adamw"):
        axes = {a.name: a for a in tune.ARMS[name].axes}
        assert axes["beta2"].scale == "cat"
        assert axes["beta2"].choices == pytest.approx((0.95, kept), rel=1e-12)
        assert (axes["embed_lr_factor"].center, axes["embed_lr_factor"].step) == (1.0, 2.0)
        assert axes["warmup_share"].scale == "lin"
    ablation = {a.name: a for a in tune.ARMS["ablation"].axes}
    assert ablation["warmup_share"].scale == "lin"
    assert (ablation["embed_lr_factor"].center, ablation["embed_lr_factor"].step) == (1.0, 2.0)
    arm = tune.ARMS["ablation"]
    point = {"lr": 4e-3, "decay_fraction": 0.4, "warmup_share": 0.0, "embed_lr_factor": 0.5}
    assert load_config(str(REPO / arm.config), arm.overrides(point, 500)).optim.embed_lr == 2e-3
    arm = tune.ARMS["baseline"]
    point = {"lr": 2e-3, "warmup_share": 0.05, "weight_decay": 0.1, "final_lr_ratio": 0.1}
    point |= {"beta2": kept, "embed_lr_factor": 4.0}
    cfg = load_config(str(REPO / arm.config), arm.overrides(point, 500))
    assert cfg.optim.beta2 == kept  # every digit: 1 - beta2 sets the half-life
    assert cfg.optim.embed_lr == pytest.approx(8e-3, rel=1e-5)
    point["embed_lr_factor"] = 1.0
    assert load_config(str(REPO / arm.config), arm.overrides(point, 500)).optim.embed_lr == 0


def test_the_untied_heads_lr_is_a_factor_of_the_embeddings():
    """head_lr_factor: optim.head_lr = factor x the embedding's lr (lr x embed_lr_factor where the
    arm has one); 1 leaves optim.head_lr at 0, the head then in the embedding's group."""
    from gptrain.config.load import load_config

    arm = tune.ARMS["nanochat_adamw"]
    point = {a.name: a.center for a in arm.axes} | {"lr": 2e-3, "embed_lr_factor": 4.0}
    point["head_lr_factor"] = 0.25
    cfg = load_config(str(REPO / arm.config), arm.overrides(point, 500)).optim
    assert cfg.embed_lr == pytest.approx(8e-3, rel=1e-5)
    assert cfg.head_lr == pytest.approx(2e-3, rel=1e-5)
    recipe = tune.ARMS["nanochat"]
    point = {a.name: a.center for a in recipe.axes} | {"lr": 4e-3, "head_lr_factor": 0.5}
    assert load_config(str(REPO / recipe.config), recipe.overrides(point, 500)).optim.head_lr == pytest.approx(2e-3, rel=1e-5)  # fmt: skip
    point["head_lr_factor"] = 1.0
    assert load_config(str(REPO / recipe.config), recipe.overrides(point, 500)).optim.head_lr == 0  # fmt: skip


def test_the_nanochat_arms_are_their_gpt2_twins_on_nanochats_block():
    """configs/study_nanochat*.toml equal the recipe's and the baseline's configs but for the
    block (and run.dir): the same data, batch, steps, evaluation and optimizer; their arms search
    the same axes and the untied head's lr; and at the study's sizes nanochat's blocks hold
    12C^2 per layer, GPT-2's 12C^2 + 13C."""
    import tomllib

    from gptrain.model.gpt import GPT, GPTConfig
    from gptrain.model.nanochat import NanoChat, NanoChatConfig

    for nano, gpt2 in (("nanochat", "recipe"), ("nanochat_adamw", "baseline")):
        a, b = (tomllib.loads((REPO / tune.ARMS[n].config).read_text()) for n in (nano, gpt2))
        assert a["model"].pop("arch") == "nanochat" and b["model"].pop("gelu") == "erf"
        for t in (a, b):
            t["run"].pop("dir")
        assert a == b
        assert tune.ARMS[nano].axes == (*tune.ARMS[gpt2].axes, tune.HEAD_AXIS)
    for c, h in ((64, 4), (96, 6)):
        n = NanoChat(NanoChatConfig(vocab_size=256, block_size=16, n_layer=4, n_head=h, n_embd=c))
        g = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=h, n_embd=c))
        blocks = [sum(p.numel() for k, p in m.named_parameters() if ".h." in k) for m in (n, g)]
        assert blocks == [4 * 12 * c * c, 4 * (12 * c * c + 13 * c)]


class FakeTrain:
    """gptrain train's exit codes in turn; the run writes summary.json when it exits 0."""

    def __init__(self, run_dir, codes):
        self.run_dir, self.codes, self.calls = run_dir, list(codes), 0

    def __call__(self, cmd, **kwargs):
        self.calls += 1
        code = self.codes.pop(0)
        if code == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "summary.json").write_text(json.dumps({"val_loss": 3.5}))
        return subprocess.CompletedProcess(cmd, code)


def test_a_trial_that_hung_once_runs_again_and_gives_its_loss(tmp_path, monkeypatch):
    run_dir = tmp_path / "baseline" / "lr=0.004"
    fake = FakeTrain(run_dir, [watchdog.EXIT_CODE, 0])
    monkeypatch.setattr(tune.subprocess, "run", fake)
    assert tune.train_trial(tune.ARMS["baseline"], run_dir, []) == 3.5
    assert fake.calls == 2


@pytest.mark.parametrize("codes", [[watchdog.EXIT_CODE, watchdog.EXIT_CODE], [-9]])
def test_a_trial_hung_twice_or_killed_stops_the_tuning_instead_of_counting_as_diverged(
    tmp_path, monkeypatch, codes
):
    run_dir = tmp_path / "baseline" / "lr=0.004"
    monkeypatch.setattr(tune.subprocess, "run", FakeTrain(run_dir, codes))
    with pytest.raises(tune.Stopped, match="run the same command to continue"):
        tune.train_trial(tune.ARMS["baseline"], run_dir, [])


def test_a_trial_that_diverged_counts_as_infinitely_bad(tmp_path, monkeypatch):
    run_dir = tmp_path / "baseline" / "lr=0.004"
    monkeypatch.setattr(tune.subprocess, "run", FakeTrain(run_dir, [1]))
    assert tune.train_trial(tune.ARMS["baseline"], run_dir, []) == math.inf
