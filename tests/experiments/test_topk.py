"""The Top-K measures behind notebooks/topk_candidates.ipynb, on hand cases with known answers, and the notebook's
committed results."""

import nbformat
import numpy as np
import pytest

from csa2.layout import layer_plan
from csa2.presets import preset
from experiments import results, topk
from infer import stats
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


def test_distance_by_role_puts_each_missed_entry_in_its_bin():
    """Layer 4 (ratio 1, the only Full layer with mass): a query at position 40 attends 0.5 to entry 39 (distance
    1, read) and 0.5 to entry 8 (distance 32, missed); earlier queries do not count (at most index_topk visible
    entries)."""
    layer = 4
    assert layer_plan(MINI)[layer].ratio == 1 and layer_plan(MINI)[layer].role == "full"
    s = 41
    mass, ids = np.zeros((s, s)), np.full((s, MINI.index_topk), -1)
    mass[40, [39, 8]] = 0.5
    ids[40, 0] = 39
    mass[3, 0] = 1.0  # 4 visible entries ≤ index_topk: not counted
    out = topk.distance_by_role(MINI, summary(MINI, _record(layer, mass, ids), [0, 16, 64]))["full"]
    np.testing.assert_allclose(out["mass"], [0.5, 0.5])
    np.testing.assert_allclose(out["missed"], [0.0, 0.5])
    assert out["intervals"] == [None, None]  # one prompt


def test_distance_by_role_needs_the_bins_at_probe_time():
    layer, s = 4, 41
    rec = summary(MINI, _record(layer, np.zeros((s, s)), np.full((s, MINI.index_topk), -1)))
    with pytest.raises(ValueError, match=r"give probe\(\.\.\., edges=\)"):
        topk.distance_by_role(MINI, rec)


def test_recall_by_position_bins_the_counted_queries():
    layer, s = 4, 41
    mass, ids = np.zeros((s, s)), np.full((s, MINI.index_topk), -1)
    mass[[38, 40], 0] = 1.0
    ids[38, 0] = 0  # position 38 read its entry, position 40 did not
    out = topk.recall_by_position(MINI, summary(MINI, _record(layer, mass, ids)), [0, 39, 41])["full"]
    np.testing.assert_allclose(out["value"]["recall"], [1.0, 0.0])
    np.testing.assert_allclose(out["value"]["oracle"], [1.0, 1.0])


def test_distance_runs_to_the_last_token_of_a_compressed_entry():
    """Layer 1 (ratio 2: entry i covers tokens 2i, 2i+1): the query at position 39 is at distance 0 from entry 19
    and 2 from entry 18."""
    layer, s = 1, 40
    assert layer_plan(MINI)[layer].ratio == 2
    mass, ids = np.zeros((s, s // 2)), np.full((s, MINI.index_topk), -1)
    mass[39, [18, 19]] = 0.5
    out = topk.distance_by_role(MINI, summary(MINI, _record(layer, mass, ids), [0, 1, 2, 3]))
    np.testing.assert_allclose(out[layer_plan(MINI)[layer].role]["mass"], [0.5, 0.0, 0.5])


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


def test_position_and_distance_intervals_resample_prompts():
    """Two prompts, each with one counted query at position 40 of layer 4 (ratio 1): the first reads its entry at
    distance 1, the second misses it. Every figure is the pooled mean with an interval over the two prompts, the
    per-layer rows included: recall 0.5 in [0, 1], and the missed mass likewise."""
    layer, s = 4, 41
    records = []
    for read in (True, False):
        mass, ids = np.zeros((s, s)), np.full((s, MINI.index_topk), -1)
        mass[40, 39] = 1.0
        ids[40, 0] = 39 if read else -1
        records.append(_record(layer, mass, ids))
    both = Probe(**{f: np.concatenate([getattr(r, f) for r in records], axis=1) for f in ("mass", "topk", "scan",
                                                                                          "pool")})
    rec = summary(MINI, both, [0, 16])
    (row,) = [r for r in topk.layer_table(MINI, rec) if r["layer"] == layer]
    by_pos = topk.recall_by_position(MINI, rec, [0, 41])["full"]
    by_distance = topk.distance_by_role(MINI, rec)["full"]
    for iv in (row["intervals"]["recall"], by_pos["intervals"][0]["recall"], by_distance["intervals"][0]["missed"]):
        assert (iv["value"], iv["lo"], iv["hi"], iv["n"]) == (0.5, 0.0, 1.0, 2)
    assert by_pos["intervals"][0]["oracle"]["lo"] == 1.0 and by_distance["intervals"][0]["mass"]["lo"] == 1.0


def test_the_committed_results_hold_the_measures_definitions():
    """notebooks/topk_candidates.json, the notebook's full run on the shipped 40-layer model: no layer reads more of
    its Global mass than the oracle of its size (up to float rounding); every interval stands on the prompts of its
    section; the distance bins cover every distance of the prompts, so each role's mass shares sum to 1; recall
    grows with `index_topk`, and a Reindex layer's pool holds more of its mass as it grows; the probe reached
    16K-token prompts."""
    got = results.load("topk_candidates", fast=False)
    assert not got["fast"] and got["model"]["name"] == "tiny-v41" and got["model"]["layers"] == 40
    held, long = got["held_out"], got["long"]
    assert long["tokens"] == 16384 and held["distance"]["edges"][-1] == held["tokens"]
    for part in (held, long):
        assert all(iv["n"] == part["prompts"] for _, iv in results.intervals(part))
    for row in held["layers"]:
        iv = row["intervals"]
        assert iv["recall"]["value"] <= iv["oracle"]["value"] + 1e-3, row["layer"]
    for role in held["distance"]["roles"].values():
        assert sum(role["mass"]) == pytest.approx(1.0, abs=1e-4)
        assert all(m <= a + 1e-9 for m, a in zip(role["missed"], role["mass"]))
    for role in ("full", "reindex", "reuse"):
        recall = [p["roles"][role]["intervals"]["recall"]["value"] for p in got["sweeps"]["index_topk"]]
        assert recall == sorted(recall) and recall[-1] > recall[0], role
    pools = [p["roles"]["reindex"]["intervals"]["pool"]["value"] for p in got["sweeps"]["candidate_topk_blocks"]]
    assert pools == sorted(pools)


def test_the_notebooks_prose_quotes_its_results():
    """The headline figures of the notebook's reading are the saved results, so a re-run that moves them fails
    here until the prose is rewritten."""
    got = results.load("topk_candidates", fast=False)
    prose = " ".join(nbformat.read(results.ROOT / "notebooks" / "topk_candidates.ipynb",
                                   as_version=4).cells[-1].source.split())
    roles, long = got["held_out"]["roles"], got["long"]
    first, last = (long["by_position"]["full"]["intervals"][i] for i in (0, -1))
    blocks = {p["value"]: p["roles"]["reindex"]["intervals"]["recall"] for p in got["sweeps"]["candidate_topk_blocks"]}
    quoted = [roles["full"]["intervals"]["recall"], roles["full"]["intervals"]["oracle"],
              roles["reuse"]["intervals"]["recall"], roles["reuse"]["intervals"]["oracle"],
              roles["reindex"]["intervals"]["recall"], roles["reindex"]["intervals"]["scan"], blocks[64], blocks[128],
              first["recall"], last["recall"], last["oracle"]]
    for iv in quoted:
        assert stats.interval_text(iv, ".3f") in prose, iv
    assert f"{long['peak_gib']:.2f} GiB" in prose
