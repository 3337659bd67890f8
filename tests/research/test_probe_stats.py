"""`ProbeStats` (`research.probe_stats`) against its definitions: every statistic the compiled model reduces, block
by block, equals the NumPy reference (`tests/research/host_summary.py`) computed from the full per-entry record of
`Probes` on the same run, and a planted mutant is caught."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import model
from csa2.presets import preset
from csa2.replay import ReplayPolicy
from research import probe_stats
from research.probe import Probes
from research.probe_stats import ProbeStats
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


@pytest.mark.parametrize("stats, replay, match", [
    (ProbeStats(), ReplayPolicy(window=8), "ProbeStats with replay"),
    (ProbeStats(block=0), None, "ProbeStats.block=0"),
    (ProbeStats(edges=(0, 8, 4)), None, r"ProbeStats.edges=\(0, 8, 4\)"),
])
def test_bad_settings_are_refused_by_name(mini_params, tokens, stats, replay, match):
    kwargs = {} if replay is None else {"replay": replay}
    with pytest.raises(ValueError, match=match):
        model.forward(MINI, mini_params, tokens, instrument=stats, **kwargs)
