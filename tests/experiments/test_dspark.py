"""The DSpark measurements behind notebooks/dspark.ipynb (SPEC §12): the host loop's per-draft records against
`speculative_generate`, ECE and its bootstrap over prompts by hand, the per-γ results' shapes.

The drafter of `mini_params` is random; as in tests/infer/test_speculative.py its Markov head is made to echo the
previous token for the tokens the greedy target emits, so accepted runs, rejections and bonus tokens all occur.
"""

import dataclasses
import json

import jax.numpy as jnp
import nbformat
import numpy as np
import pytest

from csa2.checkpoints import bundled
from csa2.presets import preset
from csa2.tokenizer import encode
from experiments import dspark as ds, results
from infer import stats
from infer.generate import Sampling
from infer.schedule import SpsTable
from infer.speculative import speculative_generate
from tests.infer.drafters import echo_markov

MINI = preset("mini")
NEW = 24
TEXTS = ("hello world", "abcdefgh", "The with statement")
GAMMA = 3  # < dspark_block_size: the host loop verifies the whole block and caps acceptance; the loop verifies γ + 1


@pytest.fixture(scope="module")
def prompts():
    return [encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def params(mini_params, prompts):
    """`mini_params` with a Markov head that echoes the previous token for the tokens greedy decoding emits (found by
    the host loop itself: greedy output does not depend on the drafter, and no other program is compiled)."""
    emitted = ds.decode_batch(MINI, mini_params, prompts, max_new_tokens=NEW, eos_id=None).tokens
    return echo_markov(mini_params, emitted, MINI.dspark_markov_rank)


def _check_records(d: ds.Decoded, gamma: int):
    """The per-draft records add up to the per-prompt counts."""
    tries, accepts = np.zeros_like(d.position_tries), np.zeros_like(d.position_accepts)
    np.add.at(tries, (d.prompt, d.position), 1)
    np.add.at(accepts, (d.prompt, d.position), d.accept.astype(int))
    np.testing.assert_array_equal(tries, d.position_tries)
    np.testing.assert_array_equal(accepts, d.position_accepts)
    np.testing.assert_array_equal(d.position_tries[:, 0], d.row_steps)  # every verify step reaches draft 1
    np.testing.assert_array_equal(d.position_accepts.sum(1), d.accepted)
    assert d.position_tries.shape == (d.n, gamma) and (d.position < gamma).all()
    assert ((d.confidence > 0) & (d.confidence < 1)).all()


@pytest.mark.parametrize("sampling, seed", [(Sampling(), 0), (Sampling(temperature=0.7), 3)], ids=["greedy", "T0.7"])
def test_host_loop_reproduces_speculative_generate(params, prompts, sampling, seed):
    """Tokens, lengths, steps and per-position counts equal `speculative_generate`'s at γ = 3, greedy and with
    stochastic acceptance (same seed: the same key splits)."""
    ref = speculative_generate(MINI, params, prompts, max_new_tokens=NEW, eos_id=None, gamma=GAMMA, sampling=sampling,
                               seed=seed)
    got = ds.decode_batch(MINI, params, prompts, max_new_tokens=NEW, eos_id=None, gamma=GAMMA, sampling=sampling,
                          seed=seed)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(got.lengths, ref.lengths)
    np.testing.assert_array_equal(got.row_steps, ref.row_steps)
    np.testing.assert_array_equal(got.accepted, ref.accepted)
    np.testing.assert_array_equal(got.position_accepts, ref.position_accepts[:, :GAMMA])
    np.testing.assert_array_equal(got.position_tries, ref.position_tries[:, :GAMMA])
    assert ref.position_tries[:, GAMMA:].sum() == 0
    assert 0 < got.accepted.sum() < got.position_tries.sum()  # both accepted and rejected drafts occur
    _check_records(got, GAMMA)


def test_records_hold_each_drafts_own_confidence(params, prompts):
    """The first step's records are the confidences the first draft call returned, at their (row, position)."""
    got = ds.decode_batch(MINI, params, prompts, max_new_tokens=NEW, eos_id=None, gamma=GAMMA)
    p = ds.generate.plan(MINI, prompts, max_new_tokens=NEW, eos_id=None)
    bucket, capacity = ds.shapes(MINI, prompts, NEW)
    assert p.tokens.shape[1] == bucket
    state, anchor, key = ds._start(MINI, params, p.tokens, p.n_valid, p.key, np.float32(0), np.float32(1),
                                   capacity=capacity, replay=p.replay, cache_format="fp4")
    b = len(prompts)
    _, (_, _, n, c, reached, took) = ds._step(MINI, params, state, anchor, jnp.zeros(b, bool),
                                             jnp.full(b, NEW - 1, jnp.int32), key, np.int32(GAMMA), np.int32(-1),
                                             np.float32(0), np.float32(1))
    first = int(np.asarray(reached).sum())
    rows, ks = np.nonzero(np.asarray(reached))
    np.testing.assert_array_equal(got.prompt[:first], rows)
    np.testing.assert_array_equal(got.position[:first], ks)
    np.testing.assert_array_equal(got.confidence[:first], np.asarray(c)[rows, ks])
    np.testing.assert_array_equal(got.accept[:first], np.asarray(took)[rows, ks])


def test_per_gamma_results(params, prompts):
    """Four prompts in batches of 3 (the short last batch filled with repeats, counted once), at γ = 1 and 3: one
    row per prompt, one column per position, the repeats' records dropped; the same prompt decodes alike in either
    batch."""
    four = prompts + prompts[:1]
    res = ds.by_gamma(MINI, params, four, [1, GAMMA], batch=3, max_new_tokens=NEW)
    assert list(res) == [1, GAMMA]
    for g, d in res.items():
        assert d.n == 4 and d.tokens.shape == (4, NEW) and (d.lengths == NEW).all()
        assert len(d.per_position()) == g and d.acceptance_length().n == 4
        assert set(np.unique(d.prompt)) <= {0, 1, 2, 3} and d.meta["gamma"] == g
        _check_records(d, g)
        np.testing.assert_array_equal(d.tokens[3], d.tokens[0])
        np.testing.assert_array_equal(d.position_tries[3], d.position_tries[0])
    # Greedy output is the target's whatever γ; γ = 1 accepts at most one draft per step.
    np.testing.assert_array_equal(res[1].tokens, res[GAMMA].tokens)
    assert (res[1].accepted <= res[1].row_steps).all() and res[GAMMA].accepted.sum() > res[1].accepted.sum()
    # As the notebook saves them: intervals as stored dicts, a position never reached as None (no estimate).
    unreached = dataclasses.replace(res[GAMMA], position_tries=res[GAMMA].position_tries * [1, 1, 0],
                                    position_accepts=res[GAMMA].position_accepts * [1, 1, 0])
    stored = ds.acceptance_results({1: res[1], GAMMA: res[GAMMA], "cut": unreached})
    assert list(stored) == ["1", str(GAMMA), "cut"] and stored["1"]["n"] == 4
    assert stored[str(GAMMA)]["tau"] == res[GAMMA].acceptance_length().as_dict()
    assert stored[str(GAMMA)]["per_position"] == [x.as_dict() for x in res[GAMMA].per_position()]
    assert stored["cut"]["per_position"][2] is None and stored["cut"]["per_position"][1] is not None
    results.check({"gamma": stored})


def test_ece_by_hand():
    """Bins of width 0.1: {0.05: 0 of 1}, {0.12, 0.18: 1 of 2}, {0.95 ×3, 1.0: 3 of 4} (1.0 falls in the last bin)."""
    c = [0.05, 0.12, 0.18, 0.95, 0.95, 0.95, 1.0]
    a = [0, 1, 0, 1, 1, 0, 1]
    want = (1 * abs(0.05 - 0) + 2 * abs(0.15 - 0.5) + 4 * abs(0.9625 - 0.75)) / 7
    assert ds.ece(c, a, bins=10) == pytest.approx(want)
    assert ds.ece(c, a, bins=1) == pytest.approx(abs(np.mean(c) - np.mean(a)))
    assert ds.ece([0.1, 0.1], [0, 1], bins=10) == pytest.approx(0.4)  # 0.1 is the left edge of bin 1
    with pytest.raises(ValueError, match="bins=0"):
        ds.ece(c, a, bins=0)


def _decoded(confidence, accept, prompt, n):
    m = len(confidence)
    z = np.zeros((n, 1), int)
    return ds.Decoded(tokens=np.zeros((n, 1), np.int32), lengths=np.ones(n, np.int32), row_steps=np.ones(n, int),
                      accepted=np.zeros(n, int), position_accepts=z, position_tries=z,
                      confidence=np.asarray(confidence, np.float32), accept=np.asarray(accept, bool),
                      position=np.zeros(m, np.int32), prompt=np.asarray(prompt, np.int32), meta={})


def test_reliability_resamples_prompts():
    """Prompt 0 is calibrated (c = 0.5, one of two accepted), prompt 1 is not (c = 0.95, none accepted): pooled ECE
    0.475; a resample holds prompt 0 twice (ECE 0), prompt 1 twice (0.95) or one of each (0.475), so the 95 %
    interval is [0, 0.95]. Resampling drafts instead of prompts would put it elsewhere."""
    d = _decoded([0.5, 0.5, 0.95, 0.95], [1, 0, 0, 0], [0, 0, 1, 1], 2)
    rel = ds.reliability(d, bins=10)
    assert rel.ece.value == pytest.approx(0.475) and rel.ece.n == 2 and rel.m == 4
    assert (rel.ece.lo, rel.ece.hi) == pytest.approx((0.0, 0.95))
    np.testing.assert_array_equal(rel.count, [0, 0, 0, 0, 0, 2, 0, 0, 0, 2])
    assert rel.confidence[5] == pytest.approx(0.5) and rel.confidence[9] == pytest.approx(0.95)
    assert rel.observed[5].value == pytest.approx(0.5) and rel.observed[9].value == 0
    assert np.isnan(rel.observed[0].value)
    assert ds.ece(d.confidence, d.accept) == pytest.approx(rel.ece.value)
    same = ds.reliability(_decoded([0.9] * 4, [1, 0, 1, 0], [0, 0, 1, 1], 2))  # alike prompts: every resample alike
    assert same.ece.lo == same.ece.value == same.ece.hi == pytest.approx(0.4)


def test_cost_ratio_and_bad_shapes(prompts):
    table = SpsTable(widths=(2, 6), steps_per_s={1: (50.0, 20.0)}, meta={})
    assert ds.cost_ratios(table, {1: 100.0}) == {1: {2: 2.0, 6: 5.0}}
    with pytest.raises(ValueError, match="bucket=8"):
        ds.decode_batch(MINI, None, prompts, max_new_tokens=NEW, bucket=8)
    with pytest.raises(ValueError, match="gamma=0"):
        ds.decode_batch(MINI, None, prompts, max_new_tokens=NEW, gamma=0)


def test_compare_rows_are_stored_as_json_values():
    tau = stats.Interval(2.5, 2.0, 3.0, 8, 0.95)
    rows = {1: {"plain": {"batch": 1, "prompts": 8, "wall_s": 2.0, "walls_s": [2.0], "tokens_per_s": 96.0,
                          "predicted_tokens_per_s": 100.0},
                "scheduled": {"batch": 1, "prompts": 8, "wall_s": 1.0, "walls_s": [1.0], "tokens_per_s": 192.0,
                              "predicted_tokens_per_s": 180.0, "cost_ratio": 1.4, "tau": tau, "widths": {2: 3, 6: 20},
                              "steps": 23, "position_accepts": np.ones((8, 5)), "position_tries": np.ones((8, 5))}}}
    got = ds.compare_results(rows)
    assert got["1"]["plain"] == {k: v for k, v in rows[1]["plain"].items() if k != "batch"}
    assert got["1"]["scheduled"]["tau"] == tau.as_dict() and got["1"]["scheduled"]["widths"] == {"2": 3, "6": 20}
    assert "position_tries" not in got["1"]["scheduled"]
    assert json.loads(json.dumps(got)) == got


def test_context_sets_share_the_compiled_programs(params, prompts):
    """Prompt sets of different lengths run at the bucket and capacity of the longest: no new program."""
    short = [encode(t) for t in ("ab", "cdef", "g")]
    before = (ds._start._cache_size(), ds._step._cache_size())
    res = ds.by_context(MINI, params, {4: short, 19: prompts}, batch=3, max_new_tokens=NEW)
    assert (ds._start._cache_size(), ds._step._cache_size()) == before
    assert {(d.meta["bucket"], d.meta["capacity"]) for d in res.values()} == {ds.shapes(MINI, prompts, NEW)}
    assert [d.n for d in res.values()] == [3, 3] and (res[4].lengths == NEW).all()


def test_the_committed_results_agree_with_the_models_card():
    """notebooks/dspark.json, the notebook's full run on the shipped model: τ grows with γ (a longer block can only
    add accepted drafts), every figure stands on at least 64 prompts, and the γ = 5 greedy run repeats the
    measurement of the model's card (same prompts and sizes), so their intervals overlap."""
    got = results.load("dspark", fast=False)
    assert not got["fast"] and got["model"]["name"] == "tiny-v41"
    by_gamma = got["by_gamma"]
    taus = [by_gamma[str(g)]["tau"]["value"] for g in range(1, got["model"]["gamma"] + 1)]
    assert taus == sorted(taus) and taus[-1] > taus[0] + 1
    assert all(run["tau"]["n"] >= 64 for part in ("by_gamma", "by_temperature") for run in got[part].values())
    card = json.loads((bundled("tiny-v41") / "accuracy.json").read_text())["acceptance"]["acceptance_length"]
    five = by_gamma["5"]["tau"]
    assert five["lo"] <= card["hi"] and card["lo"] <= five["hi"], (five, card)


def test_the_notebooks_prose_quotes_its_results():
    """The headline figures of the notebook's reading are the saved results, so a re-run that moves them fails
    here until the prose is rewritten."""
    got = results.load("dspark", fast=False)
    prose = " ".join(nbformat.read(results.ROOT / "notebooks" / "dspark.ipynb", as_version=4).cells[-1].source.split())
    quoted = [got["by_gamma"]["1"]["tau"], got["by_gamma"]["5"]["tau"], got["by_temperature"]["0.7"]["tau"],
              got["by_temperature"]["1.0"]["tau"], got["by_context"]["32"]["tau"]]
    for iv in quoted:
        assert stats.interval_text(iv) in prose, iv
    ece = got["calibration"]["ece"]
    assert f"ECE is {stats.interval_text(ece, '.3f')}" in prose
    assert f"Over {got['calibration']['drafts']} reached drafts" in prose
