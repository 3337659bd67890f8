"""The float vs SPEC §8 numerics measurements behind notebooks/fp4_qat.ipynb."""

import dataclasses
import json

import nbformat
import numpy as np
import pytest

from csa2.presets import preset
from experiments import ledger, qat, recipe_ablations, results
from infer import stats
from train import longctx
from train.data import load_corpus
from train.loop import eval_bits

# The fp4_qat notebook's fast mode makes exactly these calls: it reloads what they compiled.
VALID = slice(0, 2048)
SEEDS = (0, 1)


def test_ablation_trains_three_runs_per_seed_and_pairs_them_by_seed(tmp_path):
    corpus = load_corpus()
    spec, cfg = qat.FAST, preset(qat.FAST_PRESET)
    assert [spec.config(r, 0).qat_from for r in qat.RUNS] == [None, 0, 1]
    valid = corpus.valid[VALID]
    got = qat.ablation(cfg, corpus.train, valid, spec, SEEDS, tmp_path)
    runs = got["runs"]
    assert list(runs) == list(qat.RUNS) and all(list(r) == ["0", "1"] for r in runs.values())
    assert all(set(r) == {"float", "fp4"} and all(np.isfinite(v) and v > 0 for v in r.values())
               for by_seed in runs.values() for r in by_seed.values())
    assert runs["qat"]["0"] != runs["qat"]["1"]  # a seed is another initialization and other batches
    for run, by_seed in runs.items():
        gaps = [r["fp4"] - r["float"] for r in by_seed.values()]
        assert got["across_seeds"][run]["gap"] == stats.seed_interval(gaps).as_dict(6)  # gaps of order 1e-4
        assert got["across_seeds"][run]["float"]["n"] == len(SEEDS)
        diffs = [r["fp4"] - runs["float"][s]["fp4"] for s, r in by_seed.items()]
        assert got["vs_first"][run]["fp4"] == stats.seed_interval(diffs).as_dict(6)  # per seed, not mean − mean
    lines = {p: p.read_text() for p in tmp_path.glob("seed*/*/metrics.jsonl")}
    assert len(lines) == 6 and all(json.loads(t.splitlines()[-1])["step"] == spec.steps for t in lines.values())
    assert qat.ablation(cfg, corpus.train, valid, spec, SEEDS, tmp_path) == got  # finished runs are reused
    assert all(p.read_text() == text for p, text in lines.items())
    with pytest.raises(ValueError, match="fields steps differ"):  # another recipe is never a cache hit
        qat.ablation(cfg, corpus.train, valid, dataclasses.replace(spec, steps=3), SEEDS, tmp_path)
    with pytest.raises(ValueError, match="fields config differ"):
        qat.ablation(dataclasses.replace(cfg, sliding_window=32), corpus.train, valid, spec, SEEDS, tmp_path)
    (tmp_path / "seed0" / "0" / longctx.RECIPE).unlink()
    with pytest.raises(ValueError, match="no recipe.json"):
        qat.ablation(cfg, corpus.train, valid, spec, SEEDS, tmp_path)


def test_numerics_gap_pairs_the_two_numerics_window_by_window():
    cfg, params, _ = longctx.checkpoint(fast=True, log=lambda _: None)
    valid = load_corpus().valid[VALID]
    gap = qat.numerics_gap(cfg, params, valid, seq_len=256)
    bits = {n: eval_bits(cfg, params, valid, qat=n == "fp4", batch_size=1, seq_len=256) for n in ("float", "fp4")}
    windows = len(bits["float"][0])
    assert windows == -(-(len(valid) - 1) // 256) and all(iv["n"] == windows for iv in gap.values())
    for numerics, (b, c) in bits.items():
        assert gap[numerics]["value"] == pytest.approx(b.sum() / c.sum(), abs=1e-6)
    assert gap["gap"]["value"] == pytest.approx(gap["fp4"]["value"] - gap["float"]["value"], abs=2e-6)
    assert gap["float"]["value"] != gap["fp4"]["value"]
    # Paired: the gap's interval is the spread of the per-window differences, far narrower than either level's.
    assert gap["gap"]["hi"] - gap["gap"]["lo"] < (gap["float"]["hi"] - gap["float"]["lo"]) / 10


def test_qat_vs_float_scores_both_arms_while_they_train_and_records_them(tmp_path):
    s = qat.settings(fast=True)
    assert s.ledger and s.curve_every == 1 and set(qat.ARMS) <= set(recipe_ablations.FULL.arms)
    got = qat.qat_vs_float(s)
    assert list(got["runs"]) == list(qat.ARMS) and all(list(r) == ["0", "1"] for r in got["runs"].values())
    assert all(list(c) == ["1"] for by_seed in got["curves"].values() for c in by_seed.values())
    for arm, overrides in qat.ARMS.items():
        recipe = dataclasses.replace(s.base, **overrides, seed=0)
        assert recipe.qat == (arm == "recipe")
        assert ledger.lookup(s.ledger, recipe_ablations.run_recipe(recipe), "passkey") == got["runs"][arm]["0"]
    again = qat.qat_vs_float(dataclasses.replace(s, out=str(tmp_path / "runs")))  # read from the ledger
    assert again == got and not (tmp_path / "runs").exists()


def test_the_committed_results_hold_their_definitions():
    """notebooks/fp4_qat.json, the notebook's full run: three seeds everywhere; each interval stands on the
    samples it names; the corpus gaps are the seeds' fp4 − float; the shipped checkpoint's gap is its two levels'
    difference over every 2048-token window of the validation text; the QAT-vs-float figures are the ledger's."""
    got = results.load("fp4_qat", fast=False)
    assert not got["fast"] and got["seeds"] == [0, 1, 2]
    corpus = got["corpus"]
    for run, by_seed in corpus["runs"].items():
        assert list(by_seed) == ["0", "1", "2"]
        gaps = [r["fp4"] - r["float"] for r in by_seed.values()]
        assert corpus["across_seeds"][run]["gap"] == stats.seed_interval(gaps).as_dict(6)
    shipped = got["shipped"]
    windows = -(-(load_corpus().valid.size - 1) // shipped["window"])
    assert shipped["window"] == 2048 and all(shipped[k]["n"] == windows for k in ("float", "fp4", "gap"))
    assert shipped["gap"]["value"] == pytest.approx(shipped["fp4"]["value"] - shipped["float"]["value"], abs=2e-6)
    arms, s = got["qat_vs_float"], qat.settings(fast=False)
    assert got["qat_vs_float"]["steps"] == s.base.steps and list(arms["runs"]) == list(qat.ARMS)
    for arm, overrides in qat.ARMS.items():
        for seed in s.seeds:
            key = recipe_ablations.run_recipe(dataclasses.replace(s.base, **overrides, seed=seed))
            assert arms["runs"][arm][str(seed)] == ledger.lookup(s.ledger, key, "passkey")
            assert arms["curves"][arm][str(seed)] == ledger.lookup(s.ledger, key, f"curve every {s.curve_every}")
        assert arms["across_seeds"][arm]["128"]["digits"]["n"] == len(s.seeds)


def test_the_notebooks_prose_quotes_its_results():
    """The figures of the notebook's reading are the saved results, so a re-run that moves them fails here until the
    prose is rewritten."""
    got = results.load("fp4_qat", fast=False)
    prose = " ".join(nbformat.read(results.ROOT / "notebooks" / "fp4_qat.ipynb", as_version=4).cells[-1].source.split())
    corpus, shipped, arms = got["corpus"], got["shipped"], got["qat_vs_float"]
    float_arm = list(qat.ARMS)[1]
    quoted = [*((corpus["across_seeds"][run]["gap"], "+.5f") for run in qat.RUNS),
              *((corpus["vs_first"][run]["float"], "+.4f") for run in qat.RUNS[1:]),
              (shipped["float"], ".4f"), (shipped["fp4"], ".4f"), (shipped["gap"], "+.5f"),
              (arms["across_seeds"]["recipe"]["128"]["digits"], ".2f"),
              (arms["across_seeds"][float_arm]["128"]["digits"], ".2f"),
              *((arms["vs_first"][float_arm][length]["digits"], "+.2f") for length in ("128", "256", "512"))]
    for iv, form in quoted:
        assert stats.interval_text(iv, form) in prose, iv
    assert f"in {shipped['gap']['n']} windows of {shipped['window']} tokens" in prose
    per_seed = {arm: [r["128"]["digits"]["value"] for r in arms["runs"][arm].values()] for arm in qat.ARMS}
    assert f"float seed 1 {per_seed[float_arm][1]:.3f}" in prose
    assert f"QAT seeds 0 and 1 {per_seed['recipe'][0]:.3f} and {per_seed['recipe'][1]:.3f}" in prose
