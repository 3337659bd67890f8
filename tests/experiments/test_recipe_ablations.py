"""The recipe ablations behind notebooks/recipe_ablations.ipynb: the hidden-digit task, runs keyed on their recipe,
statistics paired by seed, the read-budget sweep on the trained checkpoints."""

import dataclasses
import json

import nbformat
import numpy as np
import pytest

from csa2.presets import BOS_ID
from csa2.tokenizer import decode
from experiments import ledger, recipe_ablations as ra, results
from infer import stats

S = ra.FAST  # the notebook's fast mode runs exactly this: it restores what the fixture trained


@pytest.fixture(scope="module")
def done():
    return ra.run(S)


def test_hidden_digit_rows_hide_one_digit_and_ask_for_it_at_the_end():
    inputs, targets, weights, distance = ra.hidden_digit_rows(np.random.default_rng(0), 200, 40)
    assert inputs.shape == targets.shape == weights.shape == (200, 40)
    np.testing.assert_array_equal(targets[:, :-1], inputs[:, 1:])  # next-token targets
    assert (inputs[:, 0] == BOS_ID).all() and {decode(r[-1:]) for r in inputs} == {"?"}
    assert (weights[:, -1] == 1).all() and not weights[:, :-1].any()  # only the digit counts
    for row, target, d in zip(inputs, targets, distance):
        body = decode(row[1:-1])
        assert len(body) == 38 and sum(c.isdigit() for c in body) == 1 and body.replace(
            decode(target[-1:]), "").isalpha()
        assert body[len(body) - d] == decode(target[-1:])  # d tokens before the "?" at position 39
    assert distance.min() >= 1 and distance.max() <= 38 and len(set(distance)) > 30


def test_statistics_pair_arms_by_seed():
    values = {"a": {"0": 0.1, "1": 0.3, "2": 0.2}, "b": {"0": 0.4, "1": 0.5, "2": 0.6}}
    got = ra.across_seeds(values)
    assert got["across_seeds"]["b"] == stats.seed_interval([0.4, 0.5, 0.6]).as_dict()
    assert got["vs_first"]["b"] == stats.seed_interval([0.3, 0.2, 0.4]).as_dict()  # per seed, not mean − mean
    assert got["vs_first"]["a"]["value"] == 0.0
    assert ra.across_seeds({"a": {"0": 0.1}})["across_seeds"]["a"] is None  # one seed: no interval


def test_every_experiment_reports_n_and_intervals(done):
    assert set(done) == {"init_scale", "ablate", "read_budget"}
    results.check(done)
    stds, seeds = [f"{s:g}" for s in S.stds], [str(s) for s in S.seeds]
    init = done["init_scale"]
    assert list(init["runs"]) == stds and all(list(r) == seeds for r in init["runs"].values())
    assert all(run["all"]["n"] == S.task.eval_rows and run["near"]["n"] + run["far"]["n"] == S.task.eval_rows
               for r in init["runs"].values() for run in r.values())
    assert all(init["across_seeds"][s]["n"] == len(S.seeds) for s in stds)
    keys = len(S.base.eval_depths) * S.base.eval_samples
    for arm in S.arms:
        for seed in seeds:
            for length in map(str, S.base.eval_lengths):
                cell = done["ablate"]["runs"][arm][seed][length]
                assert cell["keys"]["n"] == keys and cell["digits"]["n"] == keys * S.base.digits
        assert done["ablate"]["across_seeds"][arm][str(S.base.eval_lengths[0])]["digits"]["n"] == len(S.seeds)
    budgets = done["read_budget"]
    assert list(budgets["across_seeds"]) == list(S.budgets)


def test_the_trained_budget_reads_as_the_ablation_scored_it(done):
    """`read_budget` at the arm's own budget is the same checkpoint, prompts and reads as `ablate`'s score."""
    trained = next(name for name, b in S.budgets.items()
                   if b == (S.base.index_topk, S.base.candidate_topk_blocks))
    for seed in map(str, S.seeds):
        for length, cell in done["ablate"]["runs"][S.budget_arm][seed].items():
            swept = done["read_budget"]["runs"][seed][trained][length]
            assert {k: swept[k] for k in cell} == cell


def test_a_budget_changes_what_is_read():
    """A budget of one entry reads less than the trained one: the answers' bits move, paired per key."""
    cfg, params = ra._fitted(dataclasses.replace(S.base, seed=0), S.out, "recipe", log=lambda _: None)
    recipe = dataclasses.replace(S.base, seed=0)
    swept = ra.read_budget(cfg, params, recipe, {"trained": (128, 32), "one": (1, 1)})
    length = str(recipe.eval_lengths[0])
    assert swept["trained"][length]["vs_first"] is None
    assert swept["one"][length]["vs_first"]["n"] == len(recipe.eval_depths) * recipe.eval_samples
    assert swept["one"][length]["bits"]["value"] != swept["trained"][length]["bits"]["value"]


def test_finished_runs_are_reused_and_another_recipe_is_refused(done):
    again = ra.ablate(S.base, S.arms, S.seeds, S.out, curve_every=S.curve_every)  # restored: the same figures
    assert again == done["ablate"]
    with pytest.raises(ValueError, match="fields lr differ"):
        ra.ablate(dataclasses.replace(S.base, lr=1e-3), S.arms, S.seeds, S.out)
    with pytest.raises(ValueError, match="fields lr differ"):
        ra.init_scale(dataclasses.replace(S.task, lr=1.0), S.stds, S.seeds, f"{S.out}/init-scale")


def test_a_clone_reads_the_ledger_instead_of_training(done, tmp_path):
    """With every score in the ledger, `run` on an empty runs directory trains nothing and gives the same results."""
    assert ra.missing(S) == []
    assert ra.run(dataclasses.replace(S, out=str(tmp_path / "runs"))) == done
    assert not (tmp_path / "runs").exists()


def test_record_trains_a_slice_and_missing_says_what_is_left(done, tmp_path):
    s = dataclasses.replace(S, ledger=str(tmp_path / "ledger.json"))  # the fixture's runs, an empty ledger
    left = ra.missing(s)
    assert len(left) == len(S.stds) * len(S.seeds) + len(S.arms) * len(S.seeds)
    assert "ablate arm 'recipe' seed 0: passkey, curve every 1, read budgets" in "\n".join(left)
    ra.record(s, parts=["ablate"], arms=["no induction rows"], seeds=[1])  # restored from S.out: no step trains
    assert ra.missing(s) == [line for line in left
                             if line != "ablate arm 'no induction rows' seed 1: passkey, curve every 1"]
    assert ra.ablate(S.base, {"no induction rows": {"repeat_share": 0.0}}, (1,), "nowhere", ledger=s.ledger)[
        "runs"] == {"no induction rows": {"1": done["ablate"]["runs"]["no induction rows"]["1"]}}
    ra.record(s, parts=["read_budget"], arms=["recipe"])  # the budget arm's sweeps, every seed
    assert not any("read budgets" in line for line in ra.missing(s))


@pytest.mark.parametrize("kwargs, match", [
    ({"arms": ["nope"]}, r"arms=\['nope'\]: \['nope'\] not among"),
    ({"seeds": [7]}, r"seeds=\[7\]: \[7\] not among"),
    ({"parts": ["other"]}, r"parts=\['other'\]"),
])
def test_record_refuses_what_the_settings_do_not_hold(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ra.record(S, **kwargs)
    for needs_a_ledger in (ra.record, ra.missing):
        with pytest.raises(ValueError, match="Settings.ledger=None"):
            needs_a_ledger(dataclasses.replace(S, ledger=None))


def test_the_command_records_a_slice(done, capsys):
    assert ra.main(["--fast", "--part", "ablate", "--arm", "recipe", "--seed", "0"]) == 0
    assert "still to train: nothing" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        ra.main(["--fast", "--arm", "nope"])
    assert exit_.value.code == 2 and "arms=['nope']" in capsys.readouterr().err


def test_claims_say_whether_an_interval_excludes_zero(done):
    lines = ra.claims(done)
    comparisons = (len(S.stds) - 1) + (len(S.arms) - 1 + len(S.budgets) - 1) * len(S.base.eval_lengths)
    assert len(lines) == comparisons and all("(95 %, n = 2 seeds)" in line for line in lines)
    iv = stats.seed_interval
    assert ra._claim("a vs b", "x", iv([0.1, 0.11, 0.12]).as_dict()).endswith("the interval excludes 0")
    assert ra._claim("a vs b", "x", iv([0.1, 0.2]).as_dict()).endswith("no difference shown")  # 2 seeds: t = 12.7
    assert ra._claim("a vs b", "x", iv([-0.3, -0.31, -0.29]).as_dict()).endswith("the interval excludes 0")


def test_a_curve_scores_the_run_while_it_trains_and_changes_nothing_else(done, tmp_path):
    """Scored at step 1 on the way (as the fixture's runs are): the run resumes bit for bit, so its final scores are
    those of the same run trained without a stop."""
    assert S.curve_every == 1
    got = ra.ablate(S.base, {"recipe": {}}, (0,), tmp_path, curve_every=1)
    curve = got["curves"]["recipe"]["0"]
    assert list(curve) == ["1"] and (tmp_path / "recipe" / "seed0" / "curve.json").exists()
    assert got["runs"]["recipe"]["0"] == done["ablate"]["runs"]["recipe"]["0"]
    unstopped = ra.ablate(S.base, {"recipe": {}}, (0,), tmp_path / "unstopped")
    assert "curves" not in unstopped and unstopped["runs"] == got["runs"]
    length = str(S.base.eval_lengths[0])
    assert curve["1"][length]["bits"] != got["runs"]["recipe"]["0"][length]["bits"]  # one step fewer
    metrics = (tmp_path / "recipe" / "seed0" / "metrics.jsonl").read_text()
    assert ra.ablate(S.base, {"recipe": {}}, (0,), tmp_path, curve_every=1) == got  # scored once, nothing trains
    assert (tmp_path / "recipe" / "seed0" / "metrics.jsonl").read_text() == metrics


def test_the_command_writes_what_it_measured(done, capsys):
    assert ra.main(["--fast"]) == 0  # every run restored: nothing trains
    assert "results:" in capsys.readouterr().out
    assert results.load("recipe_ablations", fast=True) == {"notebook": "recipe_ablations", "fast": True,
                                                           **json.loads(json.dumps(done))}


@pytest.mark.parametrize("make, match", [
    (lambda: ra.HiddenDigit(length=2), "HiddenDigit.length=2"),
    (lambda: ra.HiddenDigit(steps=0), "HiddenDigit.steps=0"),
    (lambda: dataclasses.replace(S, budget_arm="other"), "Settings.budget_arm='other'"),
    (lambda: dataclasses.replace(S, seeds=(0,)), r"Settings.seeds=\(0,\)"),
    (lambda: dataclasses.replace(S, curve_every=-1), "Settings.curve_every=-1"),
])
def test_bad_settings_are_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_results_check_names_a_malformed_interval():
    good = stats.proportion_interval(3, 10).as_dict()
    results.check({"a": [good]})
    for bad, match in (({"x": 1}, "no interval"), ({"a": {**good, "lo": 0.9}}, r"results\[a\].*lo ≤ hi"),
                       ({"a": {"b": {**good, "n": 0}}}, r"results\[a/b\].*n ≥ 1"),
                       ({"a": [{**good, "hi": float("nan")}]}, r"results\[a/0\].*finite")):
        with pytest.raises(ValueError, match=match):
            results.check(bad)


def test_results_are_saved_as_plain_numbers(monkeypatch, tmp_path):
    """A measured np.float32 and a count as np.int64 are written as the numbers they hold; anything else that is
    not JSON is refused."""
    monkeypatch.setattr(results, "ROOT", tmp_path)
    interval = {**stats.proportion_interval(3, 10).as_dict(), "value": np.float32(0.25), "n": np.int64(10)}
    results.save("x", {"a": interval, "ratio": np.float32(1.5)}, fast=True)
    got = results.load("x", fast=True)
    assert got["a"]["value"] == 0.25 and got["a"]["n"] == 10 and got["ratio"] == 1.5
    with pytest.raises(TypeError, match="ndarray"):
        results.save("x", {"a": interval, "b": np.zeros(2)}, fast=True)


def test_the_committed_ledger_holds_runs_of_the_full_settings():
    """notebooks/recipe_ablations.runs.json: every entry sits under its recipe's key, is a run the full settings
    ask for (an entry no settings name is stale), and every score in it is well-formed."""
    full = ra.FULL
    wanted = {ledger.key(ra.run_recipe(dataclasses.replace(full.base, **overrides, seed=seed)))
              for overrides in full.arms.values() for seed in full.seeds}
    wanted |= {ledger.key(ra._hidden_digit_recipe(full.task, std, seed)) for std in full.stds for seed in full.seeds}
    book = ledger.load(full.ledger)
    assert book, "the committed ledger is empty"
    for key, entry in book.items():
        assert ledger.key(entry["recipe"]) == key and key in wanted, key
        for part, score in entry["scores"].items():
            results.check(score["value"])
            assert score["commit"] and score["date"] >= "2026-12-06", (key, part)


def test_the_committed_results_are_the_ledgers_runs(tmp_path):
    """notebooks/recipe_ablations.json, the notebook's full run, is what `run` makes of the committed ledger alone:
    every run of the full settings recorded, nothing trained, the same figures."""
    assert ra.missing(ra.FULL) == []
    got = results.load("recipe_ablations", fast=False)
    assert got.pop("notebook") == "recipe_ablations" and got.pop("fast") is False
    again = ra.run(dataclasses.replace(ra.FULL, out=str(tmp_path / "runs")))
    assert got == json.loads(json.dumps(again)) and not (tmp_path / "runs").exists()


def test_the_notebooks_prose_quotes_its_results():
    """The figures of the notebook's reading are the saved results, so a re-run that moves them fails here until the
    prose is rewritten."""
    got = results.load("recipe_ablations", fast=False)
    prose = " ".join(nbformat.read(results.ROOT / "notebooks" / "recipe_ablations.ipynb",
                                   as_version=4).cells[-1].source.split())
    init, ablate, budget = got["init_scale"], got["ablate"], got["read_budget"]
    quoted = [*(init["across_seeds"][std] for std in ("0.02", "0.05", "0.1")),
              *((init["vs_first"][std], "+.2f") for std in ("0.05", "0.1")),
              ablate["across_seeds"]["recipe"]["128"]["digits"],
              *((ablate["vs_first"][arm]["128"]["digits"], "+.2f") for arm in list(ra.FULL.arms)[1:]),
              (ablate["vs_first"]["no induction rows"]["256"]["digits"], "+.2f"),
              (ablate["vs_first"]["top-k 32, 8 blocks"]["512"]["digits"], "+.2f"),
              (budget["vs_first"]["128, 32"]["128"], "+.2f"), (budget["vs_first"]["256, 64"]["512"], "+.2f")]
    for item in quoted:
        iv, form = item if isinstance(item, tuple) else (item, ".2f")
        assert stats.interval_text(iv, form) in prose, iv
    seeds = [ablate["runs"]["recipe"][s]["128"]["digits"]["value"] for s in ("0", "1", "2")]
    assert "its seeds got {:.2f}, {:.2f} and {:.2f}".format(*seeds) in prose
    claims = ra.claims(got)  # every std, arm and budget against the first, at every length
    assert claims and all(line.endswith("no difference shown") for line in claims), "a claim now excludes 0"
    assert "every one below holds 0" in prose
