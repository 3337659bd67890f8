"""The Top-K measures behind notebooks/topk_candidates.ipynb, on hand cases with known answers."""

import numpy as np
import pytest

from csa2.layout import layer_plan
from csa2.presets import preset
from experiments import topk
from research.probe import Probe
from tests.research.host_summary import summary

MINI = preset("mini")
MASS = np.array([0.1, 0.2, 0.3, 0.4])


def test_recall_counts_each_valid_id_once():
    assert topk.recall(MASS, np.array([3, 1, -1])) == pytest.approx(0.6)
    assert topk.recall(MASS, np.array([3, 3, -1])) == pytest.approx(0.4)
    assert topk.recall(MASS / 2, np.array([0, 1, 2, 3])) == pytest.approx(1.0)  # a share of the Global mass
    assert np.isnan(topk.recall(np.zeros(4), np.array([0])))


def test_oracle_takes_the_largest_mass_and_reaches_recall_one_when_it_can_hold_every_entry():
    np.testing.assert_array_equal(topk.oracle(MASS, 2), [2, 3])
    np.testing.assert_array_equal(topk.oracle(np.array([0.0, 0.5, 0.0, 0.5]), 3), [1, 3, -1])
    assert topk.recall(MASS, topk.oracle(MASS, 4)) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    mass = rng.random((5, 9))
    for k in range(1, 9):
        best = topk.recall(mass, topk.oracle(mass, k))
        other = topk.recall(mass, np.stack([rng.permutation(9)[:k] for _ in range(5)]))
        assert (best >= other - 1e-12).all()


def test_overlap_is_the_share_of_the_second_set_found_in_the_first():
    assert topk.overlap(np.array([1, 2, -1]), np.array([2, 3, -1])) == pytest.approx(0.5)
    assert topk.overlap(np.array([-1, -1]), np.array([0, 1])) == 0
    assert np.isnan(topk.overlap(np.array([0]), np.array([-1])))


def _record(layer: int, mass: np.ndarray, ids: np.ndarray, pool: np.ndarray | None = None) -> Probe:
    """A full record of MINI where only `layer` has mass `[S, N]`, reads `ids [S, K]` (and holds `pool [S, P]`)."""
    L, (s, n), k = MINI.num_hidden_layers, mass.shape, ids.shape[-1]
    full = np.zeros((L, 1, s, n))
    full[layer, 0] = mass
    sel = np.full((L, 1, s, k), -1)
    sel[layer, 0] = ids
    pools = np.full((L, 1, s, 0 if pool is None else pool.shape[-1]), -1)
    if pool is not None:
        pools[layer, 0] = pool
    return Probe(mass=full, topk=sel, scan=sel, pool=pools)


def test_misses_by_distance_puts_each_missed_entry_in_its_bin():
    """Layer 4 (ratio 1): a query at position 40 attends 0.5 to entry 39 (distance 1, read) and 0.5 to entry 8
    (distance 32, missed); earlier queries do not count (at most index_topk visible entries)."""
    layer = 4
    assert layer_plan(MINI)[layer].ratio == 1
    s = 41
    mass, ids = np.zeros((s, s)), np.full((s, MINI.index_topk), -1)
    mass[40, [39, 8]] = 0.5
    ids[40, 0] = 39
    mass[3, 0] = 1.0  # 4 visible entries ≤ index_topk: not counted
    out = topk.misses_by_distance(MINI, summary(MINI, _record(layer, mass, ids), [0, 16, 64]))[layer]
    np.testing.assert_allclose(out["mass"], [0.5, 0.5])
    np.testing.assert_allclose(out["missed"], [0.0, 0.5])


def test_misses_by_distance_needs_the_bins_at_probe_time():
    layer, s = 4, 41
    rec = summary(MINI, _record(layer, np.zeros((s, s)), np.full((s, MINI.index_topk), -1)))
    with pytest.raises(ValueError, match=r"give probe\(\.\.\., edges=\)"):
        topk.misses_by_distance(MINI, rec)


def test_recall_by_position_bins_the_counted_queries():
    layer, s = 4, 41
    mass, ids = np.zeros((s, s)), np.full((s, MINI.index_topk), -1)
    mass[[38, 40], 0] = 1.0
    ids[38, 0] = 0  # position 38 read its entry, position 40 did not
    out = topk.recall_by_position(MINI, summary(MINI, _record(layer, mass, ids)), [0, 39, 41])[layer]
    np.testing.assert_allclose(out["recall"], [1.0, 0.0])
    np.testing.assert_allclose(out["oracle"], [1.0, 1.0])


def test_distance_runs_to_the_last_token_of_a_compressed_entry():
    """Layer 1 (ratio 2: entry i covers tokens 2i, 2i+1): the query at position 39 is at distance 0 from entry 19
    and 2 from entry 18."""
    layer, s = 1, 40
    assert layer_plan(MINI)[layer].ratio == 2
    mass, ids = np.zeros((s, s // 2)), np.full((s, MINI.index_topk), -1)
    mass[39, [18, 19]] = 0.5
    out = topk.misses_by_distance(MINI, summary(MINI, _record(layer, mass, ids), [0, 1, 2, 3]))[layer]
    np.testing.assert_allclose(out["mass"], [0.5, 0.0, 0.5])


def test_layer_table_on_a_hand_case():
    layer = 6  # Reindex: reads inside the candidate pool of layer 4
    s = 40
    mass, ids = np.zeros((s, s)), np.full((s, MINI.index_topk), -1)
    mass[39, [1, 2, 3, 4]] = [0.4, 0.3, 0.2, 0.1]
    ids[39, :2] = [1, 4]
    pool = np.full((s, MINI.candidate_pool_size), -1)
    pool[39, :3] = [1, 2, 4]
    (row,) = [r for r in topk.layer_table(MINI, summary(MINI, _record(layer, mass, ids, pool))) if r["layer"] == layer]
    assert row["role"] == "reindex" and row["queries"] == 1
    assert row["recall"] == pytest.approx(0.5) and row["oracle"] == pytest.approx(1.0)
    assert row["overlap"] == pytest.approx(0.5)  # the oracle's 4 entries, 2 of them read
    assert row["pool"] == pytest.approx(0.8) and row["inside_pool"] == pytest.approx(0.5 / 0.8)
    sums, counts = row["per_prompt"]["inside_pool"]  # what by_role pools: one prompt, one counted query
    np.testing.assert_allclose(sums, [0.5 / 0.8])
    np.testing.assert_array_equal(counts, [1])


def _rows(role_layers: dict[int, str], recall: dict[int, tuple[list, list]]) -> list[dict]:
    """`layer_table`-shaped rows whose only measure is recall: per layer (Σ recall, counted queries) per prompt."""
    rows = []
    for layer, role in role_layers.items():
        sums, counts = (np.asarray(x, float) for x in recall[layer])
        rows.append({"layer": layer, "role": role, "queries": int(counts.sum()),
                     "per_prompt": {"recall": (sums, counts)}})
    return rows


def test_by_role_pools_the_counted_queries_of_its_layers():
    """Layer 4 reads everything on 4 queries, layer 5 nothing on 4: the role's recall is 4/8 (as weighting the
    layer means by their queries gives); a measure no layer has is NaN and has no interval."""
    rows = _rows({4: "full", 5: "full", 6: "reuse"},
                 {4: ([3.0, 1.0], [3, 1]), 5: ([0.0, 0.0], [1, 3]), 6: ([0.5, 0.5], [1, 1])})
    roles = topk.by_role(rows)
    assert roles["full"]["layers"] == [4, 5] and roles["full"]["queries"] == 8
    assert roles["full"]["recall"] == pytest.approx(0.5) and roles["reuse"]["recall"] == pytest.approx(0.5)
    assert np.isnan(roles["full"]["pool"]) and set(roles["full"]["intervals"]) == {"recall"}


def test_by_role_intervals_resample_prompts_not_queries():
    """Two prompts of 100 counted queries each, one at recall 0.2 and one at 0.8: the interval over prompts runs
    from 0.2 to 0.8 (n = 2); resampling the 200 queries would claim 0.5 ± 0.07. One prompt: no interval."""
    rows = _rows({4: "full"}, {4: ([20.0, 80.0], [100, 100])})
    interval = topk.by_role(rows)["full"]["intervals"]["recall"]
    assert interval["n"] == 2 and interval["value"] == pytest.approx(0.5)
    assert interval["lo"] == pytest.approx(0.2) and interval["hi"] == pytest.approx(0.8)
    assert topk.by_role(_rows({4: "full"}, {4: ([20.0], [100])}))["full"]["intervals"] is None
    nothing = topk.by_role(_rows({4: "full"}, {4: ([0.0, 0.0], [0, 0])}))["full"]  # no query counted
    assert np.isnan(nothing["recall"]) and nothing["intervals"] == {}


def test_sweep_reruns_the_model_per_value(mini_params):
    tokens = np.random.default_rng(1).integers(0, 256, (1, 40))
    rows = topk.sweep(MINI, mini_params, tokens, "index_topk", [4, 32])
    assert [r["index_topk"] for r in rows] == [4, 32]
    small, large = (r["roles"]["full"] for r in rows)
    assert small["recall"] < large["recall"]
    with pytest.raises(ValueError, match="not a ModelConfig field"):
        topk.sweep(MINI, mini_params, tokens, "topk", [4])
