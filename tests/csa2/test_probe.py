"""Probes (`forward(..., instrument=Probes())`, `research.probe`): the model's own run, with dense attention mass
recorded next to the selections every layer read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import model
from csa2.layout import layer_plan
from csa2.presets import preset
from csa2.replay import ReplayPolicy
from experiments import topk
from research.probe import Probes

MINI = preset("mini")
S = 48
# Every visible entry fits in the top-k and the candidate pool holds every entry: selection drops nothing.
COVERING = MINI.replace(index_topk=64, candidate_topk_blocks=16)


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, S)), jnp.int32)


@pytest.fixture(scope="module")
def probed(mini_params, tokens):
    return model.forward(MINI, mini_params, tokens, qat=True, instrument=Probes())


def test_probing_does_not_change_the_run(mini_params, tokens, probed):
    logits, aux = probed
    plain, plain_aux = model.forward(MINI, mini_params, tokens, qat=True)
    np.testing.assert_array_equal(logits, plain)
    np.testing.assert_array_equal(aux["load"], plain_aux["load"])
    rec = aux["tap"]
    L, K, P = MINI.num_hidden_layers, MINI.index_topk, MINI.candidate_pool_size
    assert rec.mass.shape == (L, 2, S, S) and rec.topk.shape == rec.scan.shape == (L, 2, S, K)
    assert rec.pool.shape == (L, 2, S, P)


def test_mass_is_a_sub_distribution_over_visible_entries(probed):
    rec = jax.tree.map(np.asarray, probed[1]["tap"])
    t = np.arange(S)
    for layer, spec in enumerate(layer_plan(MINI)):
        mass = rec.mass[layer]
        assert (mass >= 0).all() and (mass.sum(-1) <= 1 + 1e-5).all()
        if spec.role == "swa":
            assert not mass.any() and (rec.topk[layer] == -1).all()
            continue
        invisible = np.arange(S)[None, :] >= ((t + 1) // spec.ratio)[:, None]  # [S, N]
        assert not mass[:, invisible].any(), layer
        assert (mass.sum(-1)[:, t >= spec.ratio] > 0).all(), layer  # every query with an entry attends to it


def test_recorded_selections_follow_the_layer_roles(probed):
    rec = jax.tree.map(np.asarray, probed[1]["tap"])
    plan = layer_plan(MINI)
    for layer, spec in enumerate(plan):
        source = spec.index_source
        if spec.role == "reuse":  # reads its index source's top-k, runs no indexer
            np.testing.assert_array_equal(rec.topk[layer], rec.topk[source])
            assert (rec.scan[layer] == -1).all()
        if spec.role == "full":
            np.testing.assert_array_equal(rec.scan[layer], rec.topk[layer])
        if spec.role == "reindex":  # its top-k lies inside the pool; its full scan is recorded beside it
            chosen = topk.selected(rec.topk[layer], S)
            assert not (chosen & ~topk.selected(rec.pool[layer], S)).any()
            assert (rec.scan[layer] >= 0).sum() >= (rec.topk[layer] >= 0).sum()


def test_oracle_bounds_every_selection(probed):
    rec = jax.tree.map(np.asarray, probed[1]["tap"])
    for layer, spec in enumerate(layer_plan(MINI)):
        if spec.role == "swa":
            continue
        mass = rec.mass[layer]
        best = topk.recall(mass, topk.oracle(mass, MINI.index_topk))
        got = topk.recall(mass, rec.topk[layer])
        ok = ~np.isnan(got)
        assert (best[ok] >= got[ok] - 1e-6).all(), layer


def test_a_budget_covering_every_entry_reads_all_the_mass(mini_params, tokens):
    _, aux = model.forward(COVERING, mini_params, tokens, qat=True, instrument=Probes())
    rec = jax.tree.map(np.asarray, aux["tap"])
    for layer, spec in enumerate(layer_plan(COVERING)):
        if spec.role == "swa":
            continue
        r = topk.recall(rec.mass[layer], rec.topk[layer])
        np.testing.assert_allclose(r[~np.isnan(r)], 1, atol=1e-6, err_msg=f"layer {layer}")
        if spec.role == "reindex":  # a pool of every entry: the Reindex selection is the full scan's
            np.testing.assert_array_equal(rec.topk[layer], rec.scan[layer])


def test_probes_need_the_exact_mode(mini_params, tokens):
    with pytest.raises(ValueError, match="Probes with replay"):
        model.forward(MINI, mini_params, tokens, instrument=Probes(), replay=ReplayPolicy(window=8))
