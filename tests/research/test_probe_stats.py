"""`ProbeStats` (`research.probe_stats`) against its definitions: every statistic the compiled model reduces, block
by block, equals the NumPy reference (`tests/research/host_summary.py`) computed from the full per-entry record of
`Probes` on the same run, and a planted mutant is caught."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import model
from csa2.hooks import Instrument, Joined
from csa2.layout import layer_plan
from csa2.presets import preset
from csa2.replay import ReplayPolicy
from experiments import topk
from research import probe_stats
from research.probe import Probes
from research.probe_stats import ProbeStats
from research.selection import KVSelection, SnapKV
from tests.research.host_summary import summary

MINI = preset("mini")
S = 48
EDGES = (0, 2, 8, 24, 64)
STATS = ProbeStats(edges=EDGES, block=20)  # three blocks, the last one padded with 12 queries


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(5).integers(0, 256, (2, S)), jnp.int32)


@pytest.fixture(scope="module")
def expected(mini_params, tokens):
    _, aux = model.forward(MINI, mini_params, tokens, qat=True, instrument=Probes())
    return summary(MINI, jax.tree.map(np.asarray, aux["tap"]), EDGES)


def _differences(got, want) -> list[str]:
    """The fields of `got` that differ from `want` beyond float32 rounding."""
    out = []
    for name in ("total", "read", "oracle", "overlap", "scan", "pool", "by_distance"):
        if getattr(want, name) is None:
            if getattr(got, name) is not None:
                out.append(name)
            continue
        a, b = np.asarray(getattr(got, name), np.float64), getattr(want, name)
        if a.shape != b.shape or not np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True):
            out.append(name)
    if not np.array_equal(got.topk, want.topk):
        out.append("topk")
    return out


def test_statistics_equal_the_definitions_on_the_full_record(mini_params, tokens, expected):
    logits, aux = model.forward(MINI, mini_params, tokens, qat=True, instrument=STATS)
    plain, _ = model.forward(MINI, mini_params, tokens, qat=True)
    np.testing.assert_array_equal(logits, plain)  # measuring does not change the run
    got = jax.tree.map(np.asarray, aux["tap"])
    assert got.total.shape == (MINI.num_hidden_layers, 2, S)
    assert got.by_distance.shape == (MINI.num_hidden_layers, 2, 2, len(EDGES) - 1)
    assert _differences(got, expected) == []
    assert np.nanmax(expected.read) > 0 and np.sum(expected.by_distance[:, :, 1]) > 0  # the case is not empty


def test_a_mask_that_drops_entry_0_is_caught(mini_params, tokens, expected, mutant):
    """A planted mutant: entry 0 (the oldest, often the heaviest) read as missing."""
    mask = probe_stats.id_mask
    mutant.setattr(probe_stats, "id_mask", lambda ids, n: mask(jnp.where(ids == 0, -1, ids), n))
    _, aux = model.forward(MINI, mini_params, tokens, qat=True, instrument=STATS)
    assert "read" in _differences(jax.tree.map(np.asarray, aux["tap"]), expected)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadProbs(Instrument):
    """Taps each head's dense sink-softmax probabilities `[B, S, H, entries]` (0 on SWA layers)."""

    def tap(self, cfg, sight, read):
        b, s, h, _ = sight.q.shape
        if sight.source is None:
            return jnp.zeros((b, s, h, sight.entries))
        _, probs = sight.probs(*sight.dense_ids())
        return jnp.pad(probs, [(0, 0)] * 3 + [(0, sight.entries - probs.shape[-1])])


def test_per_head_reads_count_each_heads_mass_on_its_own_set(mini_params, tokens):
    """Under a policy that reads per head (SnapKV, as its paper), `read` is the mean over heads of each head's dense
    probability on its own set, `overlap` counts an oracle entry read by any head, and the mass not read by
    distance is the mass less what the heads read: by those definitions on the per-head probabilities of the
    same run (tapped through `Sight.probs`, the model's own softmax), computed here in NumPy."""
    policy = KVSelection(SnapKV(window=4, per_head=True), 24)
    _, aux = model.forward(MINI, mini_params, tokens, qat=True, instrument=Joined(policy, STATS))
    got = jax.tree.map(np.asarray, aux["tap"])
    _, aux = model.forward(MINI, mini_params, tokens, qat=True, instrument=Joined(policy, HeadProbs()))
    probs = np.asarray(aux["tap"], np.float64)  # [L, B, S, H, N]
    h = MINI.num_attention_heads
    assert got.topk.shape == (MINI.num_hidden_layers, 2, S, h, MINI.index_topk)
    for spec in layer_plan(MINI):
        if spec.role == "swa":
            continue
        p, ids = probs[spec.index], got.topk[spec.index]  # [B, S, H, N], [B, S, H, K]
        n = p.shape[-1]
        mine = topk.selected(ids, n)  # [B, S, H, N]
        mass = p.mean(axis=2)
        read = np.mean(np.sum(np.where(mine, p, 0.0), axis=-1), axis=-1)
        np.testing.assert_allclose(got.read[spec.index], read, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.total[spec.index], mass.sum(-1), rtol=1e-5, atol=1e-6)
        union = np.where(mine.any(axis=2), np.arange(n), -1)  # the entries some head read, as ids
        np.testing.assert_allclose(got.overlap[spec.index], topk.overlap(union, topk.oracle(mass, MINI.index_topk)),
                                   rtol=1e-6, equal_nan=True)
        visible = (np.arange(S) + 1) // spec.ratio
        counts = (visible > MINI.index_topk)[None, :] & (mass.sum(-1) > 0)
        dist = np.arange(S)[:, None] - ((np.arange(n) + 1) * spec.ratio - 1)[None, :]
        missed = np.where(counts[..., None], mass - np.mean(np.where(mine, p, 0.0), axis=2), 0.0)
        for i, (lo, hi) in enumerate(zip(EDGES[:-1], EDGES[1:])):
            want = np.sum(np.where((dist >= lo) & (dist < hi), missed, 0.0), axis=(1, 2))
            np.testing.assert_allclose(got.by_distance[spec.index][:, 1, i], want, rtol=1e-5, atol=1e-6)
    heads_differ = [not np.array_equal(got.topk[spec.index][:, 24:, 0], got.topk[spec.index][:, 24:, 1])
                    for spec in layer_plan(MINI) if spec.role != "swa"]
    assert any(heads_differ), "the case must have heads that read differently"


@pytest.mark.parametrize("stats, replay, match", [
    (ProbeStats(), ReplayPolicy(window=8), "ProbeStats with replay"),
    (ProbeStats(block=0), None, "ProbeStats.block=0"),
    (ProbeStats(edges=(0, 8, 4)), None, r"ProbeStats.edges=\(0, 8, 4\)"),
])
def test_bad_settings_are_refused_by_name(mini_params, tokens, stats, replay, match):
    kwargs = {} if replay is None else {"replay": replay}
    with pytest.raises(ValueError, match=match):
        model.forward(MINI, mini_params, tokens, instrument=stats, **kwargs)
