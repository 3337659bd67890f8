"""Tests for csa2.indexer: indexer scores, visibility, top-k, candidate pool, reindex (SPEC §4, §5)."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from csa2 import quant
from csa2.indexer import Indexer, candidate_pool, full_topk, index_queries, reindex_topk, select_topk, visible_entries
from csa2.presets import preset
from csa2.rope import apply_rope, rope_frequencies
from csa2.state import GlobalKV
from pallas_kernels import reference
from pallas_kernels.formats import INDEX, MAIN
from pallas_kernels.stored import Stored

CFG = preset("tiny")  # Hi = 4, Di = 32, index_topk = 16, blocks of 4, 8 blocks kept
# (slot, sources): a lone source, and source 1 of a 3-source stack (entry ids ≠ rows of the flat buffers)
PLACES = [(0, 1), (1, 3)]


def _stack(keys, packed=False, slot=0, sources=1):
    """A stacked GlobalKV [B, sources, N, ·] whose source `slot` holds Indexer K `keys [B, N, Di]`. The other
    sources hold large random keys, which would win every selection if they were read (Main KV unused here)."""
    b, n, di = keys.shape
    rng = np.random.default_rng(1234)
    ikeys = 10.0 * np.abs(rng.standard_normal((b, sources, n, di))).astype(np.float32)
    ikeys[:, slot] = keys
    ikey = Stored.quantized(jnp.asarray(ikeys), INDEX) if packed else Stored(jnp.asarray(ikeys), None, INDEX)
    return GlobalKV(kv=Stored(jnp.zeros((b, sources, n, CFG.head_dim), jnp.float32), None, MAIN), ikey=ikey)


def _gkv(keys, packed=False, slot=0, sources=1):
    """The SourceKV view of `keys [B, N, Di]` (see `_stack`)."""
    return _stack(keys, packed, slot, sources).source(slot)


def _pad(a, di=CFG.index_head_dim):
    """Zero features appended up to `di` (the INDEX block is 32): dot products are unchanged."""
    a = jnp.asarray(a, jnp.float32)
    return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, di - a.shape[-1])])


def _random(seed, b=2, s=6, n=40, hi=CFG.index_n_heads, di=CFG.index_head_dim):
    """Random qI [B, S, Hi, Di], w [B, S, Hi], keys [B, N, Di] (float32 numpy)."""
    rng = np.random.default_rng(seed)
    qI = rng.standard_normal((b, s, hi, di)).astype(np.float32)
    w = rng.standard_normal((b, s, hi)).astype(np.float32)
    keys = rng.standard_normal((b, n, di)).astype(np.float32)
    return qI, w, keys


def _np_scores(qI, w, keys):
    """score[b, s, n] = Σ_h w_h relu(qI_h · k_n), float64."""
    dots = np.einsum("bshd,bnd->bshn", qI.astype(np.float64), keys.astype(np.float64))
    return np.einsum("bshn,bsh->bsn", np.maximum(dots, 0.0), w.astype(np.float64))


def _np_topk(scores, valid, k):
    """Brute force: top-min(k, #valid) ids by score, ascending, −1-padded to k."""
    out = np.full(scores.shape[:-1] + (k,), -1, np.int64)
    for idx in np.ndindex(scores.shape[:-1]):
        cols = np.flatnonzero(valid[idx])
        best = cols[np.argsort(-scores[idx][cols], kind="stable")[:k]]
        out[idx][: len(best)] = np.sort(best)
    return out


def _np_pool(scores, positions, ratio, size, kb):
    """Brute force candidate pool (SPEC §5), P = kb·size."""
    b, s, n = scores.shape
    blocks = -(-n // size)
    out = np.full((b, s, kb * size), -1, np.int64)
    for i, j in np.ndindex(b, s):
        vis = min((positions[i, j] + 1) // ratio, n)
        bscore = {}
        for blk in range(blocks):
            members = [e for e in range(blk * size, min((blk + 1) * size, n)) if e < vis]
            if members:
                bscore[blk] = np.inf if blk == (vis - 1) // size else max(scores[i, j, e] for e in members)
        kept = sorted(sorted(bscore, key=lambda blk: -bscore[blk])[:kb])
        for slot, blk in enumerate(kept):
            for m in range(size):
                e = blk * size + m
                out[i, j, slot * size + m] = e if e < vis else -1
    return out


def test_hand_computed_scores_both_layouts():
    """`index_scores` is now `reference.indexer_scores` (every entry of a stored Indexer K) and
    `reference.indexer_scores_gathered` (per-query entry ids); features are zero-padded to Di = 32."""
    # 2 heads, Di = 2, 2 entries. Dots: head0·k0 = 1, head0·k1 = 2, head1·k0 = −1 (relu → 0), head1·k1 = 1.
    qI = _pad([[[[1.0, 2.0], [-1.0, 1.0]]]])  # [1, 1, 2, Di]
    w = jnp.array([[[0.5, 2.0]]])  # [1, 1, 2]
    keys = _pad([[[1.0, 0.0], [0.0, 1.0]]])  # [1, 2, Di]
    ikey = Stored(keys, None, INDEX)
    expected = np.array([[[0.5 * 1 + 2.0 * 0, 0.5 * 2 + 2.0 * 1]]])  # without relu entry 0 would be −1.5
    shared = reference.indexer_scores(qI, w, ikey, jnp.array([[2]], jnp.int32))
    assert shared.shape == (1, 1, 2) and shared.dtype == jnp.float32
    np.testing.assert_allclose(shared, expected, rtol=1e-6)
    # entries at or beyond `visible` are −inf
    np.testing.assert_array_equal(reference.indexer_scores(qI, w, ikey, jnp.array([[1]], jnp.int32)),
                                  [[[0.5, -np.inf]]])
    gathered = reference.indexer_scores_gathered(qI, w, ikey, jnp.array([[[0, 1]]], jnp.int32),
                                                 jnp.array([[2]], jnp.int32))  # [1, 1, P=2]
    np.testing.assert_allclose(gathered, expected, rtol=1e-6)
    # Per-query layout: each query has its own gathered keys (swap the entries for query 1).
    qI2, w2 = jnp.concatenate([qI, qI], axis=1), jnp.concatenate([w, w], axis=1)
    per_query = jnp.array([[[0, 1], [1, 0]]], jnp.int32)  # [1, 2, 2]
    np.testing.assert_allclose(
        reference.indexer_scores_gathered(qI2, w2, ikey, per_query, jnp.array([[2, 2]], jnp.int32)),
        [[[0.5, 3.0], [3.0, 0.5]]], rtol=1e-6)
    # ids < 0 and ids ≥ visible are −inf
    np.testing.assert_array_equal(
        reference.indexer_scores_gathered(qI2, w2, ikey, jnp.array([[[1, -1], [1, 0]]], jnp.int32),
                                          jnp.array([[2, 1]], jnp.int32)),
        [[[3.0, -np.inf], [-np.inf, 0.5]]])


@pytest.mark.parametrize("seed", [0, 1])
def test_scores_match_numpy(seed):
    qI, w, keys = _random(seed)
    n = keys.shape[1]
    ikey = Stored(jnp.asarray(keys), None, INDEX)
    everything = jnp.full(qI.shape[:2], n, jnp.int32)
    np.testing.assert_allclose(reference.indexer_scores(qI, w, ikey, everything), _np_scores(qI, w, keys),
                               rtol=1e-5, atol=1e-5)
    ids = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[::-1], qI.shape[:2] + (n,))
    np.testing.assert_allclose(reference.indexer_scores_gathered(qI, w, ikey, ids, everything),
                               _np_scores(qI, w, keys)[..., ::-1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"ikey\.payload\.shape"):
        reference.indexer_scores(qI, w, Stored(jnp.asarray(keys[0]), None, INDEX), everything)


@pytest.mark.parametrize("slot,sources", PLACES)
@pytest.mark.parametrize("ratio", [1, 2])
def test_visibility(ratio, slot, sources):
    t = np.arange(12)
    vis = np.asarray(visible_entries(jnp.asarray(t[None], jnp.int32), ratio))[0]
    np.testing.assert_array_equal(vis, [sum(i < (tt + 1) // ratio for i in range(100)) for tt in t])
    # Keys grow with i, so the newest (possibly invisible) entries always score highest.
    n = 12 // ratio
    keys = np.tile(np.arange(1, n + 1, dtype=np.float32)[:, None], (1, CFG.index_head_dim))[None]
    qI = np.ones((1, 12, CFG.index_n_heads, CFG.index_head_dim), np.float32)
    w = np.ones((1, 12, CFG.index_n_heads), np.float32)
    positions = jnp.asarray(t[None], jnp.int32)
    for k in (2, CFG.index_topk):
        topk, scores = full_topk(CFG.replace(index_topk=k), qI, w, _gkv(keys, False, slot, sources), positions, ratio)
        for tt in t:
            visible = [i for i in range(n) if i < (tt + 1) // ratio]
            expected = visible[-k:] + [-1] * (k - len(visible[-k:]))
            assert list(np.asarray(topk[0, tt])) == expected, (k, tt)
            assert np.all(np.isneginf(scores[0, tt, len(visible):]))
            assert np.all(np.isfinite(scores[0, tt, : len(visible)]))


@pytest.mark.parametrize("seed", range(3))
def test_select_topk_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    b, s, n = 2, 5, 20
    scores = rng.permutation(b * s * n).reshape(b, s, n).astype(np.float32)  # distinct
    valid = rng.random((b, s, n)) < 0.4
    valid[0, 0] = False  # no valid column at all
    for k in (1, 3, 8, n, n + 7):  # k > n works
        got = np.asarray(select_topk(jnp.asarray(scores), jnp.asarray(valid), k))
        assert got.shape == (b, s, k) and got.dtype == np.int32
        np.testing.assert_array_equal(got, _np_topk(scores, valid, k))
        for row in got.reshape(-1, k):  # ascending ids first, then −1 padding only at the end
            ids = row[row >= 0]
            assert np.all(np.diff(ids) > 0) and np.all(row[len(ids):] == -1)
    # ids maps columns to entry ids, and the result is sorted by id, not by column.
    ids = np.broadcast_to(np.arange(n)[::-1] * 10, (b, s, n)).astype(np.int32)
    got = np.asarray(select_topk(jnp.asarray(scores), jnp.asarray(valid), 4, ids=jnp.asarray(ids)))
    expected = _np_topk(scores, valid, 4)
    mapped = np.where(expected >= 0, (n - 1 - expected) * 10, np.iinfo(np.int32).max)
    np.testing.assert_array_equal(got, np.where(np.sort(mapped) == np.iinfo(np.int32).max, -1, np.sort(mapped)))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ratio", [1, 2])
def test_full_topk_random_matches_brute_force(seed, ratio):
    qI, w, keys = _random(seed, n=40)
    positions = np.array([[0, 3, 17, 30, 62, 79], [1, 8, 9, 40, 50, 78]], np.int32)
    cfg = CFG.replace(index_topk=12)
    slot, sources = PLACES[seed % 2]  # the SourceKV view is built inside the trace, at a traced slot
    fn = jax.jit(lambda g, slot, qI, w, pos: full_topk(cfg, qI, w, g.source(slot), pos, ratio))
    topk, scores = fn(_stack(keys, False, slot, sources), jnp.int32(slot), qI, w, jnp.asarray(positions))
    ref = _np_scores(qI, w, keys)
    visible = np.arange(40) < ((positions + 1) // ratio)[..., None]
    np.testing.assert_allclose(np.where(visible, scores, 0), np.where(visible, ref, 0), rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(np.asarray(scores)[~visible]))
    expected = _np_topk(ref, visible, 12)
    topk = np.asarray(topk)
    # Compare the selected score values (robust to float32 near-ties and to exact relu-zero ties) ...
    for idx in np.ndindex(topk.shape[:-1]):
        got_ids, exp_ids = topk[idx][topk[idx] >= 0], expected[idx][expected[idx] >= 0]
        assert len(got_ids) == len(exp_ids) and np.all(visible[idx][got_ids])
        np.testing.assert_allclose(np.sort(ref[idx][got_ids]), np.sort(ref[idx][exp_ids]), rtol=1e-5, atol=1e-5)
    # ... and the ids themselves wherever the brute-force boundary is not a near-tie.
    assert np.mean(topk == expected) > 0.95


@pytest.mark.parametrize("slot,sources", PLACES)
def test_full_topk_packed_equals_float_of_dequantized_keys(slot, sources):
    qI, w, keys = _random(3, n=24)
    positions = jnp.asarray(np.tile(np.arange(18, 24), (2, 1)), jnp.int32)
    fq = np.asarray(quant.fake_quant(jnp.asarray(keys), quant.INDEX))
    packed = full_topk(CFG, qI, w, _gkv(keys, True, slot, sources), positions, 1)
    floated = full_topk(CFG, qI, w, _gkv(fq, False, slot, sources), positions, 1)
    np.testing.assert_array_equal(packed[0], floated[0])
    np.testing.assert_array_equal(packed[1], floated[1])


def test_index_queries():
    cfg = CFG
    params = nnx.to_pure_dict(nnx.state(Indexer(cfg, rngs=nnx.Rngs(0))))
    assert params["wq"].shape == (cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
    assert params["ww"].shape == (cfg.hidden_size, cfg.index_n_heads)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, cfg.hidden_size)), jnp.float32)
    q_lat = jnp.asarray(rng.standard_normal((2, 3, cfg.q_lora_rank)), jnp.float32)
    positions = jnp.array([[0, 5, 1000], [7, 8, 65000]], jnp.int32)
    qI, w = index_queries(cfg, params, x, q_lat, positions, quantize=False)
    assert qI.shape == (2, 3, cfg.index_n_heads, cfg.index_head_dim) and w.shape == (2, 3, cfg.index_n_heads)
    assert w.dtype == jnp.float32
    raw = (np.asarray(q_lat, np.float64) @ np.asarray(params["wq"], np.float64)).reshape(qI.shape)
    np.testing.assert_allclose(qI[0, 0], raw[0, 0], rtol=1e-5, atol=1e-6)  # position 0: no rotation
    r = cfg.qk_rope_head_dim
    np.testing.assert_allclose(qI[..., :-r], raw[..., :-r], rtol=1e-5, atol=1e-6)  # only the trailing dims rotate
    freqs = rope_frequencies(r, cfg.compress_rope_theta, cfg.rope_scaling)  # YaRN compressed-branch RoPE
    np.testing.assert_allclose(qI, apply_rope(jnp.asarray(raw, jnp.float32), positions[:, :, None], freqs),
                               rtol=1e-4, atol=1e-5)
    ww = np.asarray(params["ww"], np.float64)
    scale = cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5
    np.testing.assert_allclose(w, np.asarray(x, np.float64) @ ww * scale, rtol=1e-5, atol=1e-7)
    # quantize=True is exactly MXFP4 fake-quant of the rotated query (bitwise); w is unchanged.
    qI_q, w_q = index_queries(cfg, params, x, q_lat, positions, quantize=True)
    np.testing.assert_array_equal(np.asarray(qI_q), np.asarray(quant.fake_quant(qI, quant.INDEX)))
    np.testing.assert_array_equal(np.asarray(w_q), np.asarray(w))
    assert not np.array_equal(np.asarray(qI_q), np.asarray(qI))
    with pytest.raises(ValueError, match="q_lat.shape"):
        index_queries(cfg, params, x, q_lat[..., :-1], positions, quantize=False)


def test_candidate_pool_hand_case():
    cfg = CFG.replace(candidate_block_size=2, candidate_topk_blocks=2, index_topk=4)
    # N = 7 (not divisible by 2) → 4 blocks {0,1} {2,3} {4,5} {6}. Query t = 4, ratio 1 → 5 visible (0..4).
    scores = jnp.array([[[5.0, 1.0, 2.0, 9.0, -3.0, 100.0, 200.0]]])  # entries 5, 6 invisible but huge
    pool = candidate_pool(cfg, scores, jnp.array([[4]], jnp.int32), 1)
    assert pool.shape == (1, 1, cfg.candidate_pool_size) == (1, 1, 4)
    # Block maxima over visible entries: 5, 9, −3 (entry 5 ignored), ·; newest block {4,5} pinned although lowest;
    # the best other block {2,3} is kept, block {0,1} dropped; entry 5 is not visible → −1.
    np.testing.assert_array_equal(pool[0, 0], [2, 3, 4, -1])
    # Fewer blocks than candidate_topk_blocks: keep every block with a visible entry, then −1 blocks.
    wide = cfg.replace(candidate_topk_blocks=6)
    pool = candidate_pool(wide, scores, jnp.array([[2]], jnp.int32), 1)
    assert pool.shape == (1, 1, 12)
    np.testing.assert_array_equal(pool[0, 0], [0, 1, 2, -1] + [-1] * 8)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("n,size,kb,ratio", [(13, 4, 2, 1), (16, 4, 3, 2), (10, 3, 8, 1), (32, 4, 4, 1)])
def test_candidate_pool_matches_brute_force(seed, n, size, kb, ratio):
    cfg = CFG.replace(candidate_block_size=size, candidate_topk_blocks=kb, index_topk=size)
    rng = np.random.default_rng(seed)
    b, s = 2, 8
    scores = rng.permutation(b * s * n).reshape(b, s, n).astype(np.float32)  # distinct
    positions = rng.integers(0, n * ratio + 3, (b, s)).astype(np.int32)  # includes empty and saturated rows
    positions[0, :2] = [0, n * ratio - 1]
    pool = jax.jit(candidate_pool, static_argnums=(0, 3))(cfg, jnp.asarray(scores), jnp.asarray(positions), ratio)
    assert pool.shape == (b, s, kb * size) == (b, s, cfg.candidate_pool_size) and pool.dtype == jnp.int32
    np.testing.assert_array_equal(pool, _np_pool(scores, positions, ratio, size, kb))
    vis = (positions + 1) // ratio
    assert np.all((np.asarray(pool) < vis[..., None]) | (np.asarray(pool) == -1))


def _pool_case(seed, n=40, s=6):
    qI, w, keys = _random(seed, n=n, s=s)
    positions = jnp.asarray(np.array([[0, 5, 11, 22, 33, 39], [2, 17, 18, 19, 30, 38]])[:, :s], jnp.int32)
    return qI, w, keys, positions


@pytest.mark.parametrize("slot,sources", PLACES)
@pytest.mark.parametrize("packed", [False, True])
def test_reindex_with_complete_pool_equals_full(packed, slot, sources):
    qI, w, keys, positions = _pool_case(4)
    gkv = _gkv(keys, packed, slot, sources)
    cfg = CFG.replace(index_topk=8, candidate_block_size=4, candidate_topk_blocks=10)  # 10 blocks: all kept
    full, scores = full_topk(cfg, qI, w, gkv, positions, 1)
    pool = candidate_pool(cfg, scores, positions, 1)
    np.testing.assert_array_equal(reindex_topk(cfg, qI, w, gkv, pool, positions, 1), full)
    # A pool of every entry id (visible or not, P = N): visibility is still enforced.
    everything = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 6, 40))
    np.testing.assert_array_equal(reindex_topk(cfg, qI, w, gkv, everything, positions, 1), full)


@pytest.mark.parametrize("seed", range(3))
def test_reindex_with_restricted_pool(seed):
    slot, sources = PLACES[seed % 2]
    qI, w, keys, positions = _pool_case(seed)
    cfg = CFG.replace(index_topk=5, candidate_block_size=4, candidate_topk_blocks=2)  # pool of 8 < visible
    rng = np.random.default_rng(seed)
    source_scores = jnp.asarray(rng.permutation(2 * 6 * 40).reshape(2, 6, 40), jnp.float32)
    pool = candidate_pool(cfg, source_scores, positions, 1)  # a pool that disagrees with this layer's scores
    got = np.asarray(reindex_topk(cfg, qI, w, _gkv(keys, False, slot, sources), pool, positions, 1))
    pool = np.asarray(pool)
    ref = _np_scores(qI, w, keys)
    for i, j in np.ndindex(2, 6):
        chosen = got[i, j][got[i, j] >= 0]
        assert set(chosen) <= set(pool[i, j][pool[i, j] >= 0])
        cand = pool[i, j][pool[i, j] >= 0]
        best = cand[np.argsort(-ref[i, j, cand])[: cfg.index_topk]]
        np.testing.assert_array_equal(chosen, np.sort(best))


def _shapes(jaxpr):
    """Output shapes of every equation of a closed jaxpr, sub-jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        out += [tuple(v.aval.shape) for v in eqn.outvars]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _shapes(sub)
    return out


@pytest.mark.parametrize("slot,sources", PLACES)
def test_reindex_work_is_bounded_by_the_pool(slot, sources):
    b, s, n, p = 1, 2, 4096, 16  # N = capacity ≫ P
    cfg = CFG.replace(index_topk=8, candidate_block_size=4, candidate_topk_blocks=p // 4)
    qI, w, keys = _random(0, b=b, s=s, n=n)
    src = _gkv(keys, True, slot, sources)  # its flat buffers [B, sources·N, ·] enter as arguments
    pool = jnp.zeros((b, s, p), jnp.int32)
    positions = jnp.zeros((b, s), jnp.int32)

    def view(kv, ikey, offset):
        return dataclasses.replace(src, kv=kv, ikey=ikey, offset=offset)

    def reindex(qI, w, kv, ikey, offset, pool, positions):
        return reindex_topk(cfg, qI, w, view(kv, ikey, offset), pool, positions, 1)

    shapes = _shapes(jax.make_jaxpr(reindex)(qI, w, src.kv, src.ikey, src.offset, pool, positions).jaxpr)
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    assert (b, s, p, di) in shapes  # the gathered, dequantized Indexer K
    assert (b, s, hi, p) in shapes  # per-head dot products over the pool only
    assert not [sh for sh in shapes if n in sh or sources * n in sh]  # nothing is computed over all N entries

    def full(qI, w, kv, ikey, offset, positions):
        return full_topk(cfg, qI, w, view(kv, ikey, offset), positions, 1)

    full_shapes = _shapes(jax.make_jaxpr(full)(qI, w, src.kv, src.ikey, src.offset, positions).jaxpr)
    assert (b, s, hi, n) in full_shapes  # the check above would catch a full scoring pass
