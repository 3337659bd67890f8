"""KV-selection baselines (`research.selection`, SPEC §14): building blocks, the policies on hand cases with known
read masks, and the static policy configurations.

Every hand case builds a `View` whose keys are identity rows (`D = 64`, so `D^-½ = 1/8` is exact) and whose
queries are `8 · logits`: `View.logits()` returns exactly the logits written in the test. `rest` is −1e9 (no
window, no sink: the probabilities are a plain softmax over the read entries) unless a test says otherwise.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2.layout import layer_plan
from csa2.presets import preset
from research.selection import (
    H2O,
    Oracle,
    PyramidKV,
    Quest,
    SnapKV,
    StreamingLLM,
    View,
    fill_newest,
    h2o,
    mask_ids,
    newest,
    oracle,
    quest,
    recent_count,
    sink_softmax,
    snapkv,
    streaming_llm,
    top,
)

MINI = preset("mini")  # 8 layers, layer 0 SWA, index_topk 16
D = 64
NONE = -1e9  # a `rest` that adds nothing to the denominator


def make_view(logits, visible, rest=None, positions=None) -> View:
    """A `View` (B = 1) whose `logits()` are `logits [S, H, N]` where visible."""
    logits = np.asarray(logits, np.float32)
    s, h, n = logits.shape
    q = np.zeros((1, s, h, D), np.float32)
    q[0, :, :, :n] = logits * 8.0
    keys = np.eye(n, D, dtype=np.float32)[None]
    rest = np.full((s, h), NONE, np.float32) if rest is None else np.asarray(rest, np.float32)
    positions = np.arange(s) if positions is None else np.asarray(positions)
    return View(q=jnp.asarray(q), keys=jnp.asarray(keys), rest=jnp.asarray(rest)[None],
                visible=jnp.asarray(visible, jnp.int32)[None], positions=jnp.asarray(positions, jnp.int32)[None])


def stack_views(*views: View) -> View:
    """The views (B = 1 each) as one batch."""
    return View(**{f: jnp.concatenate([getattr(v, f) for v in views]) for f in ("q", "keys", "rest", "visible",
                                                                                "positions")})


def mask_of(n, *rows):
    """A bool mask `[len(rows), n]` from the sets of entry ids in each row."""
    out = np.zeros((len(rows), n), bool)
    for r, ids in enumerate(rows):
        out[r, list(ids)] = True
    return out


def ids(mask_row):
    return set(np.flatnonzero(np.asarray(mask_row)).tolist())


# ---------------------------------------------------------------------------------------------
# Building blocks

def test_newest_takes_the_newest_visible_entries():
    """`newest` is the entries [visible − count, visible), clipped at 0, per row, with scalar or per-row count."""
    got = newest(jnp.array([5, 3, 0, 8]), jnp.array(2), 8)
    np.testing.assert_array_equal(np.asarray(got), mask_of(8, {3, 4}, {1, 2}, set(), {6, 7}))
    got = newest(jnp.array([5, 3, 8]), jnp.array([1, 5, 0]), 8)  # count > visible: every visible entry
    np.testing.assert_array_equal(np.asarray(got), mask_of(8, {4}, {0, 1, 2}, set()))


def test_fill_newest_adds_newest_up_to_budget():
    """`fill_newest` keeps `keep` and adds the newest free dense entries until `budget` entries in all."""
    dense = jnp.arange(10) < 8
    keep = jnp.zeros(10, bool).at[jnp.array([0, 1])].set(True)
    np.testing.assert_array_equal(np.asarray(fill_newest(keep, dense, 5)), mask_of(10, {0, 1, 5, 6, 7})[0])
    # keep among the newest: the fill skips it and goes one further back
    keep2 = jnp.zeros(10, bool).at[jnp.array([0, 7])].set(True)
    np.testing.assert_array_equal(np.asarray(fill_newest(keep2, dense, 4)), mask_of(10, {0, 5, 6, 7})[0])
    # budget at or below the keep count: nothing is added (and keep is never dropped)
    np.testing.assert_array_equal(np.asarray(fill_newest(keep, dense, 2)), np.asarray(keep))
    np.testing.assert_array_equal(np.asarray(fill_newest(keep, dense, 1)), np.asarray(keep))
    # budget beyond the dense count: every dense entry
    np.testing.assert_array_equal(np.asarray(fill_newest(keep, dense, 12)), np.asarray(dense))
    # a traced budget and per-row dense masks
    dense2 = jnp.arange(10) < jnp.array([[8], [3]])
    keep3 = jnp.stack([keep, keep])
    got = jax.jit(fill_newest)(keep3, dense2, jnp.int32(4))
    np.testing.assert_array_equal(np.asarray(got), mask_of(10, {0, 1, 6, 7}, {0, 1, 2}))


def test_top_largest_scores_among_where_ties_to_lower_id():
    """`top` picks the `count` largest scores among `where`, ties to the lower id, count scalar/traced/per-row."""
    scores = jnp.array([3.0, 1.0, 3.0, 2.0, 5.0])
    where = jnp.array([True, True, True, True, False])  # entry 4 (largest) is excluded
    np.testing.assert_array_equal(np.asarray(top(scores, where, 2)), mask_of(5, {0, 2})[0])
    np.testing.assert_array_equal(np.asarray(top(scores, where, 3)), mask_of(5, {0, 2, 3})[0])
    np.testing.assert_array_equal(np.asarray(top(scores, where, 0)), mask_of(5, set())[0])
    np.testing.assert_array_equal(np.asarray(top(scores, where, 9)), np.asarray(where))  # count > |where|
    ties = jnp.array([1.0, 2.0, 2.0, 2.0, 0.0])
    np.testing.assert_array_equal(np.asarray(top(ties, jnp.ones(5, bool), 2)), mask_of(5, {1, 2})[0])
    np.testing.assert_array_equal(np.asarray(jax.jit(top)(scores, where, jnp.int32(1))), mask_of(5, {0})[0])
    rows = jnp.stack([scores, ties])
    got = jax.jit(top)(rows, jnp.stack([where, jnp.ones(5, bool)]), jnp.array([1, 3]))
    np.testing.assert_array_equal(np.asarray(got), mask_of(5, {0}, {1, 2, 3}))


def test_top_selects_a_lone_minus_inf_score_among_where():
    """`top` selects an entry of `where` whose score is −inf when the count leaves room for it."""
    got = top(jnp.array([0.0, -jnp.inf]), jnp.array([False, True]), 1)
    np.testing.assert_array_equal(np.asarray(got), [False, True])


@pytest.mark.parametrize("seed", range(4))
def test_top_with_an_int_count_equals_the_ranking_of_every_entry(seed):
    """A Python-int count (one partial top_k) selects what a traced count (two sorts of every entry) does, with
    ties, −inf scores inside and outside `where`, and counts from 0 past |where|: the two paths are one rule."""
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 4, (3, 5, 12)).astype(np.float32)  # few distinct values: many ties
    scores[rng.random(scores.shape) < 0.2] = -np.inf
    where = jnp.asarray(rng.random(scores.shape) < 0.7)
    for count in (0, 1, 3, 7, 12, 20):
        np.testing.assert_array_equal(np.asarray(top(jnp.asarray(scores), where, count)),
                                      np.asarray(jax.jit(top)(jnp.asarray(scores), where, jnp.int32(count))))


def test_recent_count_is_floor_of_share():
    """`recent_count` is ⌊share · budget⌋: a Python int for an int budget, int32 for an array budget."""
    assert recent_count(8, 0.25) == 2 and isinstance(recent_count(8, 0.25), int)
    assert recent_count(7, 0.5) == 3
    assert recent_count(16, 0.0) == 0 and recent_count(16, 1.0) == 16
    got = recent_count(jnp.array([10, 3]), 0.25)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), [2, 0])
    assert int(jax.jit(lambda b: recent_count(b, 0.5))(jnp.int32(9))) == 4


def test_sink_softmax_has_rest_in_the_denominator():
    """`sink_softmax` is exp(l_e) / (Σ exp(l) + exp(rest)); −inf logits get 0; rest −inf is a plain softmax."""
    logits = jnp.array([[1.0, 2.0, -jnp.inf, 0.0], [0.0, 0.0, 0.0, 0.0]])
    rest = jnp.array([np.log(2.0), -jnp.inf], jnp.float32)
    e = np.e
    want = np.array([[e, e * e, 0.0, 1.0] / np.float64(e + e * e + 1 + 2), [0.25] * 4])
    np.testing.assert_allclose(np.asarray(sink_softmax(logits, rest)), want, rtol=1e-6, atol=0)


def test_view_probs_and_mass():
    """`View.logits` is −inf off visible; a `read` mask restricts the softmax; `mass` is the head mean of dense
    probs."""
    lg = np.array([[[0.0, np.log(3.0), 5.0], [np.log(2.0), 0.0, 5.0]]])  # S=1, H=2, N=3; entry 2 invisible
    v = make_view(lg, [2], rest=[[0.0, np.log(1.0)]])
    assert np.isneginf(np.asarray(v.logits())[0, 0, :, 2]).all()
    np.testing.assert_allclose(np.asarray(v.probs())[0, 0], [[1 / 5, 3 / 5, 0], [2 / 4, 1 / 4, 0]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(v.mass())[0, 0], [(1 / 5 + 2 / 4) / 2, (3 / 5 + 1 / 4) / 2, 0], rtol=1e-6)
    read = jnp.array([[[False, True, True]]])
    sparse = sink_softmax(jnp.where(read[:, :, None, :], v.logits(), -jnp.inf), v.rest)  # as H2O reads
    np.testing.assert_allclose(np.asarray(sparse)[0, 0], [[0, 3 / 4, 0], [0, 1 / 2, 0]], rtol=1e-6)


def test_view_mass_in_blocks_equals_the_whole_mass():
    """`mass` a few queries at a time (a last block padded) is the head mean of the dense probabilities."""
    rng = np.random.default_rng(4)
    v = make_view(rng.normal(size=(7, 3, 9)), [1, 2, 4, 5, 7, 8, 9], rest=rng.normal(size=(7, 3)))
    whole = np.asarray(jnp.mean(v.probs(), axis=2))
    for block in (1, 3, 7, 256):
        np.testing.assert_allclose(np.asarray(v.mass(block)), whole, rtol=1e-6, atol=1e-7, err_msg=f"block {block}")


# ---------------------------------------------------------------------------------------------
# Oracle

def _oracle_view():
    # H=2, N=8; query 0 sees 6 entries, query 1 all 8. Entry 6 (invisible to query 0) dominates both heads.
    head0 = [0, 4, 0, 0, 0, 0, 9, 0]
    head1 = [0, 0, 0, 3, 2, 0, 9, 0]
    return make_view([[head0, head1], [head0, head1]], [6, 8], rest=np.zeros((2, 2)))


def test_oracle_reads_largest_head_mean_probability():
    """`oracle` reads the budget entries of largest head-mean probability, never an invisible one."""
    v = _oracle_view()
    # query 0: mean probs e1 ≈ .458, e3 ≈ .318, e4 ≈ .122, the rest ≈ .024 (e6 invisible);
    # query 1: e6 ≈ .994, e1 ≈ .0034, e3 ≈ .0013, e4 ≈ .0005
    np.testing.assert_array_equal(np.asarray(oracle(v, 3))[0], mask_of(8, {1, 3, 4}, {1, 3, 6}))
    np.testing.assert_array_equal(np.asarray(oracle(v, 2))[0], mask_of(8, {1, 3}, {1, 6}))
    np.testing.assert_array_equal(np.asarray(Oracle().mask(MINI.replace(index_topk=1), v, 0, jnp.array([0])))[0],
                                  mask_of(8, {1}, {6}))


def test_oracle_is_top_of_the_mass_ties_included():
    """The oracle's `top_k` picks what `top` (ranking every entry) picks, on logits with many equal values."""
    rng = np.random.default_rng(6)
    v = make_view(rng.integers(0, 3, (6, 2, 10)).astype(float), [1, 3, 5, 8, 10, 10])
    for budget in (1, 4, 10, 12):
        want = np.asarray(top(v.mass(), v.dense(), budget))
        np.testing.assert_array_equal(np.asarray(oracle(v, budget)), want, err_msg=f"budget {budget}")


def test_oracle_full_budget_reads_every_visible_entry():
    """`oracle` with budget ≥ visible reads every visible entry (recall 1) and nothing invisible."""
    v = _oracle_view()
    for budget in (8, 12, jnp.int32(8)):
        np.testing.assert_array_equal(np.asarray(oracle(v, budget)), np.asarray(v.dense()))
    np.testing.assert_array_equal(np.asarray(oracle(v, 6))[0, 0], mask_of(8, range(6))[0])


# ---------------------------------------------------------------------------------------------
# StreamingLLM

def test_streaming_llm_sinks_plus_newest():
    """`streaming_llm` reads the first `sinks` entries and the newest ones up to the budget."""
    v = make_view(np.zeros((5, 1, 10)), [10, 6, 4, 1, 0])
    np.testing.assert_array_equal(np.asarray(streaming_llm(v, 5, 2))[0],
                                  mask_of(10, {0, 1, 7, 8, 9}, {0, 1, 3, 4, 5}, {0, 1, 2, 3}, {0}, set()))
    np.testing.assert_array_equal(np.asarray(streaming_llm(v, 5, 0))[0],
                                  mask_of(10, {5, 6, 7, 8, 9}, {1, 2, 3, 4, 5}, {0, 1, 2, 3}, {0}, set()))
    got = StreamingLLM(sinks=2).mask(MINI.replace(index_topk=5), v, 0, jnp.array([0]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(streaming_llm(v, 5, 2)))


def test_streaming_llm_ignores_attention():
    """`streaming_llm` reads the same entries whatever the logits."""
    rng = np.random.default_rng(0)
    a = make_view(rng.normal(size=(3, 2, 10)) * 5, [10, 9, 7])
    b = make_view(rng.normal(size=(3, 2, 10)) * 5, [10, 9, 7])
    np.testing.assert_array_equal(np.asarray(streaming_llm(a, 4, 1)), np.asarray(streaming_llm(b, 4, 1)))


# ---------------------------------------------------------------------------------------------
# H2O

H2O_N = 12
H2O_VISIBLE = [5, 5, 5, 6, 7, 8, 9, 10]  # positions 0..7; start = 3
BIG = 1000.0  # weight of an entry that would dominate if it were read


def _h2o_weights():
    """Softmax weights [S, N] (probs = w / Σ_read w with rest −1e9)."""
    w = np.ones((8, H2O_N))
    w[0:3, :5] = [8, 1, 4, 1, 2]  # prompt: cumulative e0 1.5, e2 .75, e4 .375, e1 = e3 .1875
    w[3, [0, 1, 2, 4]] = [2, BIG, 1, 12]  # reads {0,2,4,5}: e0 .125, e2 .0625, e4 .75, e5 .0625
    w[4, [1, 2]] = BIG  # reads {0,4,5,6}: .25 each
    w[5, [1, 2, 5, 7]] = [BIG, BIG, BIG, 13]  # reads {0,4,6,7}: e7 .8125, others .0625
    w[6, [6, 7, 8]] = [BIG, 12, 2]  # reads {0,4,7,8}: e7 .75, e8 .125, e0 = e4 .0625
    w[7, [1, 2, 4, 5, 6]] = BIG  # reads {0,7,8,9}
    return w


def test_h2o_hand_case_keeps_heavy_and_evicts_for_ever():
    """`h2o`: heavy prompt entry 0 stays throughout; entries 1, 2, 5, 6, 4 once dropped are never read again."""
    w = _h2o_weights()
    v = make_view(np.log(w)[:, None, :], H2O_VISIBLE)
    got = np.asarray(h2o(v, 4, 0.5, 3, per_head=False))[0]
    want = mask_of(H2O_N,
                   range(5), range(5), range(5),  # prompt: dense
                   {0, 2, 4, 5},  # heavy {0,2} (e1, e3 light; e4 newest at the prompt's end) + newest {4,5}
                   {0, 4, 5, 6},  # e4 (1.125) beat e2 (.8125): e2 evicted although its logit is now huge
                   {0, 4, 6, 7},  # e5 left the newest with .3125 < e4 1.4375: evicted
                   {0, 4, 7, 8},  # e7 left the newest with .8125 < e4 1.4375; e6 evicted
                   {0, 7, 8, 9})  # e7 (1.5625) beat e4 (1.5): e4 evicted
    np.testing.assert_array_equal(got, want)
    got = H2O(recent=0.5, per_head=False).mask(MINI.replace(index_topk=4), v, 0, jnp.array([3]))
    np.testing.assert_array_equal(np.asarray(got)[0], want)


def test_h2o_rest_in_denominator_weighs_a_query_less():
    """`h2o`: a query with a large window/sink share (rest) adds less, changing the heavy set; batch rows apart."""
    w = _h2o_weights()
    rest = np.full((8, 1), NONE)
    rest[3] = np.log(48.0)  # query 3 reads w/64 instead of w/16: e4 ends at .5625 < e2 .765625
    plain = make_view(np.log(w)[:, None, :], H2O_VISIBLE)
    damped = make_view(np.log(w)[:, None, :], H2O_VISIBLE, rest=rest)
    got = np.asarray(h2o(stack_views(plain, damped), 4, 0.5, 3, per_head=False))
    np.testing.assert_array_equal(got[:, 3], mask_of(H2O_N, {0, 2, 4, 5}, {0, 2, 4, 5}))
    np.testing.assert_array_equal(got[:, 4], mask_of(H2O_N, {0, 4, 5, 6}, {0, 2, 5, 6}))


def test_h2o_start_at_end_and_recent_one():
    """`h2o` with start past every query reads densely; recent = 1 reads only the newest (StreamingLLM, no sinks)."""
    v = make_view(np.log(_h2o_weights())[:, None, :], H2O_VISIBLE)
    np.testing.assert_array_equal(np.asarray(h2o(v, 4, 0.5, 8, per_head=False)), np.asarray(v.dense()))
    np.testing.assert_array_equal(np.asarray(h2o(v, 4, 1.0, 0, per_head=False)), np.asarray(streaming_llm(v, 4, 0)))


def test_h2o_budget_and_eviction_properties():
    """`h2o` on random attention: post-start reads ≤ budget, within visible, newest read, evicted entries never
    return."""
    rng = np.random.default_rng(1)
    s, h, n, budget, recent, start = 24, 2, 16, 6, 0.5, 8
    nc = recent_count(budget, recent)
    positions = np.arange(s)
    visible = np.minimum(n, (positions + 2) // 2 + 3)  # grows by one every other query; ≥ budget + 1 from start
    views = [make_view(rng.normal(size=(s, h, n)) * 3, visible, rest=rng.normal(size=(s, h)), positions=positions)
             for _ in range(3)]
    reads = np.asarray(h2o(stack_views(*views), budget, recent, start, per_head=False))
    for r in reads:
        dense = np.arange(n) < visible[:, None]
        assert not (r & ~dense).any()
        np.testing.assert_array_equal(r[:start], dense[:start])
        for t in range(start, s):
            assert r[t].sum() <= budget
            assert r[t, visible[t] - nc:visible[t]].all()  # the newest ⌊recent · budget⌋ are always read
            for e in range(visible[t]):
                if r[t, e]:
                    continue
                for t2 in range(t + 1, s):  # not read at t: read later only as one of the newest
                    assert not r[t2, e] or e >= visible[t2] - nc, (t, t2, e)


# ---------------------------------------------------------------------------------------------
# SnapKV / PyramidKV

SNAP_N = 12
SNAP_VISIBLE = [6, 7, 8, 8, 8, 9, 10, 10]  # positions 0..7; start 4


def _snap_view():
    w = np.ones((8, SNAP_N))
    w[0, 3] = 1e4  # before the window (unless window = 4): would make e3 chosen
    w[1, 6] = 1e4  # likewise e6
    w[2:4, :8] = [5, 30, 2, 2, 20, 18, 3, 40]  # the observation window (positions 2, 3)
    w[4:, 2] = 1e4  # after start: must not count
    return make_view(np.log(w)[:, None, :], SNAP_VISIBLE)


def test_snapkv_kernel_one_chooses_top_scores_of_older_entries():
    """`snapkv` kernel 1: the 3 window-scored entries of largest mass among all but the newest, then newest fill."""
    got = np.asarray(snapkv(_snap_view(), 4, 0.25, 2, 1, 4, per_head=False))[0, 4:]
    # entry 7 (40, the largest) is the newest at the prompt's end: not a candidate; chosen {1, 4, 5}
    np.testing.assert_array_equal(got, mask_of(SNAP_N, {1, 4, 5, 7}, {1, 4, 5, 8}, {1, 4, 5, 9}, {1, 4, 5, 9}))


def test_snapkv_kernel_three_pooling_changes_the_choice():
    """`snapkv` kernel 3: max-pooled scores (e6 takes e7's 40, e0..e2 take e1's 30) choose {0, 1, 6}."""
    got = np.asarray(snapkv(_snap_view(), 4, 0.25, 2, 3, 4, per_head=False))[0, 4:]
    np.testing.assert_array_equal(got, mask_of(SNAP_N, {0, 1, 6, 7}, {0, 1, 6, 8}, {0, 1, 6, 9}, {0, 1, 6, 9}))
    got = SnapKV(recent=0.25, window=2, kernel=3, per_head=False).mask(MINI.replace(index_topk=4), _snap_view(), 0,
                                                                        jnp.array([4]))
    np.testing.assert_array_equal(np.asarray(got)[0, 4:], mask_of(SNAP_N, {0, 1, 6, 7}, {0, 1, 6, 8},
                                                                  {0, 1, 6, 9}, {0, 1, 6, 9}))


def test_snapkv_window_selects_the_observation_queries():
    """`snapkv` window 4 observes positions 0..3 too: their heavy e3 and e6 are chosen with e1."""
    got = np.asarray(snapkv(_snap_view(), 4, 0.25, 4, 1, 4, per_head=False))[0, 4:]
    np.testing.assert_array_equal(got, mask_of(SNAP_N, {1, 3, 6, 7}, {1, 3, 6, 8}, {1, 3, 6, 9}, {1, 3, 6, 9}))


def test_snapkv_large_budget_reads_every_visible_entry():
    """`snapkv` with a budget ≥ visible reads every visible entry from start on."""
    got = np.asarray(snapkv(_snap_view(), 12, 0.25, 2, 3, 4, per_head=False))
    np.testing.assert_array_equal(got[0, 4:], np.asarray(_snap_view().dense())[0, 4:])


def test_pyramidkv_mask_is_snapkv_at_the_layer_budget():
    """`PyramidKV.mask` at a traced layer is `snapkv` at that layer's budget (SWA layer: reads nothing)."""
    policy = PyramidKV(recent=0.25, window=2, kernel=1, beta=4.0, per_head=False)
    v = _snap_view()
    budgets = policy.budgets(MINI)
    np.testing.assert_array_equal(budgets, [0, 28, 24, 20, 16, 12, 8, 4])
    masked = jax.jit(lambda layer: policy.mask(MINI, v, layer, jnp.array([4])))
    for layer in range(MINI.num_hidden_layers):
        got = np.asarray(masked(jnp.int32(layer)))
        np.testing.assert_array_equal(got, np.asarray(snapkv(v, int(budgets[layer]), 0.25, 2, 1, 4, per_head=False)))
    np.testing.assert_array_equal(np.asarray(masked(jnp.int32(0))), np.zeros((1, 8, SNAP_N), bool))
    np.testing.assert_array_equal(np.asarray(masked(jnp.int32(7)))[0, 4:],
                                  mask_of(SNAP_N, {1, 4, 5, 7}, {1, 4, 5, 8}, {1, 4, 5, 9}, {1, 4, 5, 9}))


def test_per_row_start_matches_each_row_alone():
    """`h2o` and `snapkv` with start one per row [B] read, per row, what that row reads alone with its start."""
    rng = np.random.default_rng(2)
    s, n = 12, 12
    visible = np.minimum(n, np.arange(s) // 1 + 2)
    views = [make_view(rng.normal(size=(s, 2, n)) * 3, visible, rest=rng.normal(size=(s, 2))) for _ in range(2)]
    both = stack_views(*views)
    starts = [3, 7]
    got = np.asarray(h2o(both, 4, 0.5, jnp.array(starts), per_head=False))
    for i, v in enumerate(views):
        np.testing.assert_array_equal(got[i], np.asarray(h2o(v, 4, 0.5, starts[i], per_head=False))[0])
    got = np.asarray(snapkv(both, 4, 0.25, 2, 3, jnp.array(starts), per_head=False))
    for i, v in enumerate(views):
        np.testing.assert_array_equal(got[i], np.asarray(snapkv(v, 4, 0.25, 2, 3, starts[i], per_head=False))[0])
    got = np.asarray(H2O(recent=0.5, per_head=False).mask(MINI.replace(index_topk=4), both, 0, jnp.array(starts)))
    np.testing.assert_array_equal(got, np.asarray(h2o(both, 4, 0.5, jnp.array(starts), per_head=False)))


# ---------------------------------------------------------------------------------------------
# Quest

def test_quest_hand_case_pages_by_bound():
    """`quest` page 4: bound = Σ relu(logit) over the page (identity keys), max over heads; newest page pinned."""
    n = 16
    h0 = np.zeros((2, n))
    h1 = np.zeros((2, n))
    # query 0 (visible 14): page 1 has the largest logit (3) but page 2 the largest bound (1 + 1 + 1.5 = 3.5)
    h0[0, 4:8] = [3, -5, 0, 0]
    h0[0, 8:12] = [1, 1, 1.5, -1]
    h1[0] = -1.0  # every bound 0 on head 1
    # query 1 (visible 16): head 0 bounds page 0 at 2, head 1 page 1 at 2.5 and page 2 at 1
    h0[1, 0] = 2.0
    h1[1, 7] = 2.5
    h1[1, 8] = 1.0
    v = make_view(np.stack([h0, h1], axis=1), [14, 16])
    np.testing.assert_array_equal(np.asarray(quest(v, 8, 4, per_head=False))[0],
                                  mask_of(n, range(8, 14), [*range(4, 8), *range(12, 16)]))
    np.testing.assert_array_equal(np.asarray(quest(v, 12, 4, per_head=False))[0],
                                  mask_of(n, range(4, 14), [*range(0, 8), *range(12, 16)]))
    np.testing.assert_array_equal(np.asarray(quest(v, 4, 4, per_head=False))[0],
                                  mask_of(n, range(12, 14), range(12, 16)))
    got = Quest(page=4, per_head=False).mask(MINI.replace(index_topk=8), v, 0, jnp.array([0]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(quest(v, 8, 4, per_head=False)))


def test_quest_bound_dominates_true_logits_and_drives_the_choice():
    """`quest`: the Σ max(q·hi, q·lo)·D^-½ bound ≥ every true logit of its page, and picks the pages `quest` reads."""
    b, s, h, d, n, page, budget = 2, 4, 2, 8, 16, 4, 8
    for seed in range(3):
        rng = np.random.default_rng(seed)
        q = rng.normal(size=(b, s, h, d)).astype(np.float32)
        keys = rng.normal(size=(b, n, d)).astype(np.float32)
        visible = np.array([[16, 14, 9, 5], [12, 16, 8, 13]])
        v = View(q=jnp.asarray(q), keys=jnp.asarray(keys), rest=jnp.zeros((b, s, h)),
                 visible=jnp.asarray(visible, jnp.int32), positions=jnp.tile(jnp.arange(s), (b, 1)))
        pages = n // page
        kp = keys.reshape(b, pages, page, d).astype(np.float64)
        hi, lo = kp.max(axis=2), kp.min(axis=2)  # [B, P, D]
        qq = q.astype(np.float64)[:, :, :, None, :]  # [B, S, H, 1, D]
        bound = np.maximum(qq * hi[:, None, None], qq * lo[:, None, None]).sum(-1) / np.sqrt(d)  # [B, S, H, P]
        true = np.einsum("bshd,bnd->bshn", qq[..., 0, :], keys.astype(np.float64)) / np.sqrt(d)
        true = true.reshape(b, s, h, pages, page).max(-1)
        assert (bound >= true - 1e-9).all()
        got = np.asarray(quest(v, budget, page, per_head=False))
        for i in range(b):
            for t in range(s):
                newest_page = (visible[i, t] - 1) // page
                score = bound[i, t].max(axis=0)
                others = [p for p in np.argsort(-score, kind="stable") if p < newest_page]
                chosen = [newest_page, *others[:budget // page - 1]]
                want = np.zeros(n, bool)
                for p in chosen:
                    want[p * page:(p + 1) * page] = True
                want &= np.arange(n) < visible[i, t]
                np.testing.assert_array_equal(got[i, t], want, err_msg=f"seed {seed} row {i} query {t}")


def test_quest_evicts_nothing():
    """`quest` reads an old page again when a later query points at it (unlike the evicting policies)."""
    n = 24
    lg = np.zeros((3, 1, n))
    lg[0, 0, 1] = 5.0  # query 0 (visible 16) points at page 0
    lg[1, 0, 5] = 5.0  # query 1 (visible 20) at page 1
    lg[2, 0, 2] = 5.0  # query 2 (visible 24) at page 0 again
    v = make_view(lg, [16, 20, 24])
    got = np.asarray(quest(v, 8, 4, per_head=False))[0]
    np.testing.assert_array_equal(got, mask_of(n, [*range(0, 4), *range(12, 16)], [*range(4, 8), *range(16, 20)],
                                               [*range(0, 4), *range(20, 24)]))
    assert not Quest().evicts and not Oracle().evicts
    assert H2O().evicts and SnapKV().evicts and PyramidKV().evicts and StreamingLLM().evicts


# ---------------------------------------------------------------------------------------------
# Policies as static configuration

START = np.array([4])  # a valid start for every policy below (SnapKV's window 4 fits)


@pytest.mark.parametrize("policy, start, field", [
    (Oracle(), np.array([-1]), "policy_start"),
    (Oracle(), np.array([11]), "policy_start"),
    (H2O(), np.array([3, 11]), "policy_start"),  # one bad row is enough
    (Quest(), np.array([-2, 0]), "policy_start"),
    (StreamingLLM(sinks=17), START, "StreamingLLM.sinks"),
    (StreamingLLM(sinks=-1), START, "StreamingLLM.sinks"),
    (H2O(recent=1.5), START, "H2O.recent"),
    (H2O(recent=-0.1), START, "H2O.recent"),
    (SnapKV(window=5), START, "policy_start"),  # the observation window does not fit before start
    (SnapKV(window=2), np.array([4, 1]), "policy_start"),
    (SnapKV(window=0), START, "SnapKV.window"),
    (SnapKV(window=0), None, "SnapKV.window"),
    (SnapKV(window=2, kernel=4), START, "SnapKV.kernel"),
    (SnapKV(window=2, kernel=0), START, "SnapKV.kernel"),
    (SnapKV(window=2, recent=2.0), START, "SnapKV.recent"),
    (PyramidKV(window=2, beta=0.5), START, "PyramidKV.beta"),
    (PyramidKV(window=2, beta=17.0), START, "PyramidKV.beta"),
    (PyramidKV(window=6), START, "policy_start"),
    (PyramidKV(window=2, kernel=2), START, "PyramidKV.kernel"),
    (Quest(page=3), START, "Quest.page"),
    (Quest(page=0), START, "Quest.page"),
    (Quest(page=32), START, "Quest.page"),
])
def test_check_rejects_bad_fields(policy, start, field):
    """`.check` raises a ValueError naming the offending field (or policy_start for a bad start)."""
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        policy.check(MINI, 10, start)


@pytest.mark.parametrize("policy, start", [
    (Oracle(), np.array([0])), (Oracle(), np.array([10, 0])), (Oracle(), None),
    (StreamingLLM(sinks=16), START), (StreamingLLM(sinks=0), START),
    (H2O(recent=0.0), START), (H2O(recent=1.0), np.array([0, 10])),
    (SnapKV(window=4, kernel=1), START), (SnapKV(window=4), np.array([4, 10])), (SnapKV(window=9), None),
    (PyramidKV(window=8, kernel=5, beta=1.0), np.array([8])), (PyramidKV(window=2, beta=16.0), START),
    (Quest(page=1), START), (Quest(page=16), START), (Quest(), np.array([0])),
])
def test_check_accepts_valid_policies(policy, start):
    """`.check` accepts the boundary values of every field and of start (None: traced, unchecked)."""
    policy.check(MINI, 10, start)


@pytest.mark.parametrize("k", [4, 7, 10, 16, 31])
@pytest.mark.parametrize("beta", [1.0, 1.5, 2.0, 3.0, 4.0, "k"])
def test_pyramidkv_budgets(k, beta):
    """`PyramidKV.budgets`: 0 on SWA layers, non-increasing over readers, mean exactly K, ends ≈ 2K − K/β and K/β."""
    beta = float(k) if beta == "k" else beta
    cfg = MINI.replace(index_topk=k)
    budgets = PyramidKV(beta=beta).budgets(cfg)
    plan = layer_plan(cfg)
    readers = [s.index for s in plan if s.role != "swa"]
    assert budgets.shape == (cfg.num_hidden_layers,)
    assert all(budgets[s.index] == 0 for s in plan if s.role == "swa")
    r = budgets[readers]
    assert (np.diff(r) <= 0).all() and (r >= 1).all()
    assert r.sum() == k * len(readers)
    assert abs(r[0] - (2 * k - k / beta)) <= 1 and abs(r[-1] - k / beta) <= 1
    if beta > 1 and k >= 10:
        assert (np.diff(r) < 0).all()
    assert PyramidKV(beta=beta).width(cfg) == r.max()


def test_pyramidkv_budgets_literal():
    """`PyramidKV.budgets` on mini (K = 16): literal per-layer budgets for β = 4, 3, 1, 16."""
    np.testing.assert_array_equal(PyramidKV(beta=4.0).budgets(MINI), [0, 28, 24, 20, 16, 12, 8, 4])
    np.testing.assert_array_equal(PyramidKV(beta=3.0).budgets(MINI), [0, 27, 24, 20, 16, 12, 8, 5])
    np.testing.assert_array_equal(PyramidKV(beta=1.0).budgets(MINI), [0] + [16] * 7)
    np.testing.assert_array_equal(PyramidKV(beta=16.0).budgets(MINI), [0, 31, 26, 21, 16, 11, 6, 1])


def test_policies_are_hashable_frozen_and_width_is_budget():
    """Policies are frozen and hash by value; `width` is index_topk except PyramidKV's largest layer budget."""
    assert hash(H2O(recent=0.5)) == hash(H2O(recent=0.5)) and H2O(recent=0.5) == H2O()
    assert hash(Oracle()) == hash(Oracle()) and Oracle() == Oracle()
    assert H2O(recent=0.5) != H2O(recent=0.25) and SnapKV() != PyramidKV()
    assert len({SnapKV(), SnapKV(), PyramidKV(), Quest(), Quest(page=8), Quest(page=4)}) == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        H2O().recent = 0.25
    for p in (Oracle(), StreamingLLM(), H2O(), SnapKV(), Quest()):
        assert p.width(MINI) == MINI.index_topk
    assert PyramidKV().width(MINI) == 28
    assert {p.name for p in (Oracle, StreamingLLM, H2O, SnapKV, PyramidKV, Quest)} == {
        "oracle", "streamingllm", "h2o", "snapkv", "pyramidkv", "quest"}


# ---------------------------------------------------------------------------------------------
# Per head, as the papers choose

def _one_head(v: View, head: int) -> View:
    return View(q=v.q[:, :, head:head + 1], keys=v.keys, rest=v.rest[:, :, head:head + 1], visible=v.visible,
                positions=v.positions)


@pytest.mark.parametrize("name, choose", [
    ("h2o", lambda v, per_head: h2o(v, 5, 0.4, jnp.array([6, 9]), per_head)),
    ("snapkv", lambda v, per_head: snapkv(v, 5, 0.2, 3, 3, jnp.array([6, 9]), per_head)),
    ("quest", lambda v, per_head: quest(v, 8, 4, per_head)),
])
def test_per_head_selection_is_each_heads_own_choice(name, choose):
    """Per head, head h reads what the policy chooses for a layer of head h alone (its own cumulative scores, its
    own observation-window attention, its own page bounds), `[B, S, H, N]`; pooled, one `[B, S, N]` for all. On
    random attention the heads choose differently, and the pooled choice is none of theirs everywhere."""
    rng = np.random.default_rng(9)
    s, h, n = 14, 3, 16
    visible = np.minimum(n, np.arange(s) + 3)
    v = stack_views(*(make_view(rng.normal(size=(s, h, n)) * 3, visible, rest=rng.normal(size=(s, h)))
                      for _ in range(2)))
    got = np.asarray(choose(v, True))
    assert got.shape == (2, s, h, n)
    for head in range(h):
        np.testing.assert_array_equal(got[:, :, head], np.asarray(choose(_one_head(v, head), False)),
                                      err_msg=f"{name} head {head}")
    assert not np.array_equal(got[:, :, 0], got[:, :, 1])
    pooled = np.asarray(choose(v, False))
    assert pooled.shape == (2, s, n) and not all(np.array_equal(pooled, got[:, :, k]) for k in range(h))


def test_the_policies_that_rank_by_attention_choose_per_head_when_asked():
    """H2O, SnapKV, PyramidKV and Quest read one set per head by default (their papers), one set for the layer with
    `per_head=False`, as the oracle and StreamingLLM always do; a policy's mask has the shape `heads` says."""
    heads = MINI.num_attention_heads
    assert [p.heads(MINI) for p in (H2O(), SnapKV(), PyramidKV(), Quest())] == [heads] * 4
    pooled = (H2O(per_head=False), SnapKV(per_head=False), PyramidKV(per_head=False), Quest(per_head=False))
    assert [p.heads(MINI) for p in (*pooled, Oracle(), StreamingLLM())] == [1] * 6
    assert H2O() == H2O(per_head=True) != H2O(per_head=False)
    v = make_view(np.random.default_rng(3).normal(size=(6, heads, 12)), np.arange(6) + 6)
    cfg = MINI.replace(index_topk=4)
    for p in (H2O(per_head=True), SnapKV(window=2, per_head=True), PyramidKV(window=2, per_head=True),
              Quest(page=4, per_head=True), H2O(per_head=False), SnapKV(window=2, per_head=False),
              Quest(page=4, per_head=False), Oracle(), StreamingLLM()):
        mask = p.mask(cfg, v, jnp.int32(1), jnp.array([3]))
        assert mask.shape == ((1, 6, heads, 12) if p.heads(cfg) > 1 else (1, 6, 12)), p


@pytest.mark.parametrize("block", [1, 4, 7])
def test_a_policy_reads_the_ids_of_its_whole_mask_block_by_block(block):
    """`Policy.read` (what `KVSelection` reads: the ids, `block` queries at a time, the last block padded) is the ids
    of the mask of the whole layer, for every policy, per head and pooled, with one start per row: SnapKV chooses
    from the whole prompt though a block may not hold its observation queries, H2O carries its scores across."""
    heads, s, n = MINI.num_attention_heads, 7, 12
    rng = np.random.default_rng(5)
    v = stack_views(make_view(rng.normal(size=(s, heads, n)), np.arange(s) + 5),
                    make_view(rng.normal(size=(s, heads, n)), np.minimum(np.arange(s) + 4, n),
                              rest=rng.normal(size=(s, heads))))
    cfg, start, layer = MINI.replace(index_topk=4), jnp.array([3, 5]), jnp.int32(2)
    for p in (H2O(per_head=True), SnapKV(window=2, per_head=True), PyramidKV(window=2, per_head=True),
              Quest(page=2, per_head=True), H2O(per_head=False),
              SnapKV(window=2, per_head=False), PyramidKV(window=2, per_head=False), Quest(page=2, per_head=False),
              Oracle(), StreamingLLM(sinks=1)):
        whole = mask_ids(p.mask(cfg, v, layer, start), p.width(cfg))
        np.testing.assert_array_equal(p.read(cfg, v, layer, start, block=block), whole, err_msg=str(p))
