"""pallas_kernels: bit-exact dequant, oracles vs csa2, Pallas (interpret) vs oracles, Triton lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import attention, cache, indexer, quant
from pallas_kernels import _formats, indexer as pk_indexer, ops, reference, sparse_attention as pk_sparse

TOL = dict(rtol=1e-5, atol=1e-5)
# csa2 ops jitted once per shape: eager dispatch of their many small ops is what costs time here.
encode = jax.jit(cache.encode, static_argnums=(1, 2, 3))
gather = jax.jit(cache.gather, static_argnums=(3,))
sink_attention = jax.jit(attention.sink_attention)
index_scores = jax.jit(indexer.index_scores)
decode = jax.jit(cache.decode, static_argnums=(2,))
fake_quant = jax.jit(quant.fake_quant, static_argnums=(1,))
select_topk = jax.jit(indexer.select_topk, static_argnums=(2,))
window_ids = jax.jit(attention.window_ids, static_argnums=(2, 3))


def _bits(x):
    return np.asarray(x).view(np.uint32)


# --- formats ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,decode", [(jnp.float8_e4m3fn, _formats.e4m3_to_f32),
                                          (jnp.float8_e8m0fnu, _formats.e8m0_to_f32)])
def test_scale_decoders_exhaustive(dtype, decode):
    """Every byte decodes exactly as XLA's float8 → float32 convert (NaNs as NaN)."""
    b = jnp.arange(256, dtype=jnp.uint8)
    want = np.asarray(jax.lax.bitcast_convert_type(b, dtype).astype(jnp.float32))
    got = np.asarray(decode(b.astype(jnp.int32)))
    assert np.array_equal(np.isnan(want), np.isnan(got))
    ok = ~np.isnan(want)
    assert np.array_equal(_bits(want)[ok], _bits(got)[ok])


def test_e2m1_decoder_exhaustive():
    codes = jnp.arange(16, dtype=jnp.uint8)
    want = np.asarray(jax.lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn).astype(jnp.float32))
    assert np.array_equal(_bits(want), _bits(_formats.e2m1_to_f32(codes.astype(jnp.int32))))


@pytest.mark.parametrize("fmt,kind", [(quant.MAIN, "main"), (quant.INDEX, "index"), (quant.WINDOW, "window")])
def test_dequant_matches_csa2_bit_for_bit(fmt, kind):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 128)) * np.exp(rng.uniform(-14, 9, (3, 5, 1)))
    x[0, 0] = 0.0
    x[0, 1, :16] = -1e-9  # rounds to −0.0
    x[1, 0] = 3000.0  # main saturates
    payload, scales = jax.jit(quant.quantize, static_argnums=1)(jnp.asarray(x, jnp.float32), fmt)
    want = jax.jit(quant.dequantize, static_argnums=2)(payload, scales, fmt)
    got = jax.jit(_formats.load_entries, static_argnums=2)(*_formats.stored(payload, scales), kind)
    assert np.array_equal(_bits(want), _bits(got))


# --- sparse attention ---------------------------------------------------------------------------

def _attention_case(seed, *, b, s, h, d, n, k, window, slots, starts, floors, packed_main=True, packed_win=True):
    """A chunk at `starts` over a ring of `slots` (partially filled / wrapped) plus random top-k ids."""
    rng = np.random.default_rng(seed)
    starts, floors = jnp.asarray(starts, jnp.int32), jnp.asarray(floors, jnp.int32)
    positions = starts[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
    ring = jnp.asarray(rng.standard_normal((b, slots, d)), jnp.float32)
    chunk = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
    win = encode(jnp.concatenate([ring, chunk], axis=1), quant.WINDOW, packed_win, True)
    pos, ids = window_ids(positions, starts, window, slots)
    win_valid = pos >= jnp.maximum(floors, 0)[:, None, None]
    win_idx = jnp.where(win_valid, ids, -1)
    main = encode(jnp.asarray(rng.standard_normal((b, n, d)) * 2, jnp.float32), quant.MAIN, packed_main, True)
    main_idx = rng.integers(0, n, (b, s, k))
    main_idx[rng.random((b, s, k)) < 0.3] = -1  # −1 anywhere
    main_idx[0, -1] = -1  # a row with no Global entry
    main_idx = jnp.asarray(main_idx, jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    return (q, sink, *main, main_idx, *win, win_idx), (pos, ids, win_valid)


CASES = {
    # prefill-like chunk: top-k 37 (not a multiple of the block), wrapped ring, replay floor on row 1
    "chunk": dict(b=2, s=3, h=4, d=64, n=40, k=37, window=8, slots=10, starts=[23, 5], floors=[0, 6]),
    # decode: one row per sequence; row 0 on an almost empty ring (floor cuts everything), row 2 wrapped
    "decode": dict(b=3, s=1, h=2, d=32, n=24, k=13, window=4, slots=6, starts=[0, 3, 17], floors=[1, 0, 15]),
}


def test_reference_matches_csa2_attention():
    args, (pos, ids, win_valid) = _attention_case(1, **CASES["chunk"])
    q, sink, main, main_scale, main_idx, win, win_scale, _ = args
    keys = jnp.concatenate([gather(win, win_scale, ids, quant.WINDOW),
                            gather(main, main_scale, main_idx, quant.MAIN)], axis=2)
    valid = jnp.concatenate([win_valid, main_idx >= 0], axis=2)
    want = sink_attention(q, keys, valid, sink)
    np.testing.assert_allclose(reference.sparse_attention(*args), want, **TOL)


@pytest.mark.parametrize("case,kwargs", [
    ("chunk", dict(block_k=16, block_w=4)),
    ("chunk", dict(block_k=8, block_w=8, num_splits=2, packed_main=False)),
    ("decode", dict(block_k=4, block_w=4, num_splits=3, packed_win=False)),
])
def test_sparse_attention_pallas_matches_reference(case, kwargs):
    packed = {key: kwargs.pop(key) for key in ("packed_main", "packed_win") if key in kwargs}
    args, (pos, _, win_valid) = _attention_case(2, **CASES[case], **packed)
    want = reference.sparse_attention(*args)
    got = pk_sparse.sparse_attention(*args, interpret=True, **kwargs)
    np.testing.assert_allclose(got, want, **TOL)
    empty = ~(np.asarray(args[4] >= 0).any(-1) | np.asarray(win_valid).any(-1))  # rows with no valid entry
    assert np.asarray(got)[empty].size == 0 or np.all(np.asarray(got)[empty] == 0)


@pytest.mark.parametrize("seed", [11, 12])
def test_sparse_attention_random_shapes(seed):
    """Shapes, ring fill/wrap, floors and block sizes drawn at random (seeded)."""
    rng = np.random.default_rng(seed)
    b, s, window = int(rng.integers(1, 3)), int(rng.integers(1, 5)), int(rng.integers(1, 7))
    slots = window + int(rng.integers(0, 3))
    starts = rng.integers(0, 3 * slots, b)
    shape = dict(b=b, s=s, h=int(rng.integers(1, 6)), d=int(rng.choice([32, 64])), n=int(rng.integers(1, 50)),
                 k=int(rng.integers(1, 40)), window=window, slots=slots, starts=starts,
                 floors=starts - rng.integers(-2, window + 1, b))
    args, _ = _attention_case(seed, **shape, packed_main=bool(rng.integers(2)))
    kwargs = dict(block_k=int(rng.choice([4, 8, 16])), block_w=int(rng.choice([2, 4])),
                  num_splits=int(rng.integers(1, 4)), block_h=int(rng.choice([1, 2, 4])))
    np.testing.assert_allclose(pk_sparse.sparse_attention(*args, interpret=True, **kwargs),
                               reference.sparse_attention(*args), **TOL, err_msg=f"{shape} {kwargs}")


def test_sparse_attention_all_invalid_and_empty_sources():
    args, _ = _attention_case(3, **CASES["decode"])
    q, sink, main, main_scale, main_idx, win, win_scale, win_idx = args
    none = jnp.full_like(win_idx, -1)
    out = ops.sparse_attention(q, sink, main, main_scale, jnp.full_like(main_idx, -1), win, win_scale, none,
                               impl="pallas")
    assert np.all(np.asarray(out) == 0)
    # SWA-only layer: no Global ids at all.
    no_main = main_idx[..., :0]
    np.testing.assert_allclose(ops.sparse_attention(q, sink, main, main_scale, no_main, win, win_scale, win_idx,
                                                    impl="pallas"),
                               ops.sparse_attention(q, sink, main, main_scale, no_main, win, win_scale, win_idx), **TOL)


# --- indexer ------------------------------------------------------------------------------------

def _indexer_case(seed, *, b, s, hi, di, n, pool, packed=True):
    rng = np.random.default_rng(seed)
    q = fake_quant(jnp.asarray(rng.standard_normal((b, s, hi, di)), jnp.float32), quant.INDEX)
    w = jnp.asarray(rng.standard_normal((b, s, hi)) * (di * hi) ** -0.5, jnp.float32)
    ikey = encode(jnp.asarray(rng.standard_normal((b, n, di)), jnp.float32), quant.INDEX, packed, True)
    visible = jnp.asarray(rng.integers(0, n + 1, (b, s)), jnp.int32).at[0, 0].set(n).at[-1, -1].set(0)
    ids = rng.integers(0, n, (b, s, pool))
    ids[rng.random((b, s, pool)) < 0.25] = -1
    return q, w, *ikey, jnp.asarray(ids, jnp.int32), visible


def _same_topk(a, b, valid, k):
    np.testing.assert_array_equal(select_topk(a, valid, k), select_topk(b, valid, k))


@pytest.mark.parametrize("packed,n,block_n", [(True, 37, 16), (False, 64, 32)])
def test_indexer_scores(packed, n, block_n):
    q, w, ikey, ikey_scale, _, visible = _indexer_case(4, b=2, s=3, hi=4, di=64, n=n, pool=8, packed=packed)
    visible_mask = jnp.arange(n) < visible[..., None]
    want = jnp.where(visible_mask, index_scores(q, w, decode(ikey, ikey_scale, quant.INDEX)), -jnp.inf)
    ref = reference.indexer_scores(q, w, ikey, ikey_scale, visible)
    got = pk_indexer.indexer_scores(q, w, ikey, ikey_scale, visible, interpret=True, block_s=2, block_n=block_n)
    for x in (ref, got):
        np.testing.assert_array_equal(np.isneginf(x), ~np.asarray(visible_mask))
        np.testing.assert_allclose(x, want, **TOL)
    _same_topk(got, ref, visible_mask, 7)


@pytest.mark.parametrize("seed", [21, 22])
def test_indexer_random_shapes(seed):
    rng = np.random.default_rng(seed)
    b, s, n, pool = int(rng.integers(1, 3)), int(rng.integers(1, 6)), int(rng.integers(1, 70)), int(rng.integers(1, 30))
    q, w, ikey, ikey_scale, ids, visible = _indexer_case(seed, b=b, s=s, hi=int(rng.integers(1, 5)), di=32, n=n,
                                                         pool=pool)
    k = int(rng.integers(1, n + 1))
    visible_mask = jnp.arange(n) < visible[..., None]
    got = pk_indexer.indexer_scores(q, w, ikey, ikey_scale, visible, interpret=True,
                                    block_s=int(rng.choice([1, 2, 4])), block_n=int(rng.choice([8, 16, 64])))
    ref = reference.indexer_scores(q, w, ikey, ikey_scale, visible)
    np.testing.assert_allclose(got, ref, **TOL)
    _same_topk(got, ref, visible_mask, k)
    got = pk_indexer.indexer_scores_gathered(q, w, ikey, ikey_scale, ids, visible, interpret=True,
                                             block_p=int(rng.choice([4, 8, 32])))
    ref = reference.indexer_scores_gathered(q, w, ikey, ikey_scale, ids, visible)
    np.testing.assert_allclose(got, ref, **TOL)
    _same_topk(got, ref, ~np.isneginf(np.asarray(ref)), min(k, pool))


def test_indexer_scores_gathered_reindex():
    q, w, ikey, ikey_scale, ids, visible = _indexer_case(5, b=2, s=3, hi=4, di=64, n=30, pool=21)
    ids = ids.at[0, 1].set(-1).at[1, 0, 3].set(40)  # an all-invalid pool row; an id ≥ N
    valid = (ids >= 0) & (ids < 30) & (ids < visible[..., None])
    keys = gather(ikey, ikey_scale, ids, quant.INDEX)
    want = jnp.where(valid, index_scores(q, w, keys), -jnp.inf)
    ref = reference.indexer_scores_gathered(q, w, ikey, ikey_scale, ids, visible)
    got = ops.indexer_scores_gathered(q, w, ikey, ikey_scale, ids, visible, impl="pallas")
    for x in (ref, got):
        np.testing.assert_array_equal(np.isneginf(x), ~np.asarray(valid))
        np.testing.assert_allclose(x, want, **TOL)
    _same_topk(got, ref, valid, 5)


def test_block_max_matches_candidate_blocks():
    rng = np.random.default_rng(6)
    scores = jnp.asarray(rng.standard_normal((2, 3, 37)), jnp.float32).at[0, 0, 30:].set(-jnp.inf)
    want = jnp.pad(scores, [(0, 0), (0, 0), (0, 3)], constant_values=-jnp.inf).reshape(2, 3, 5, 8).max(-1)
    np.testing.assert_array_equal(reference.block_max(scores, 8), want)
    np.testing.assert_array_equal(pk_indexer.block_max(scores, 8, interpret=True, block_s=2, block_b=2), want)


# --- dispatch, checks, lowering -----------------------------------------------------------------

def test_bad_arguments_raise():
    args, _ = _attention_case(7, **CASES["decode"])
    with pytest.raises(ValueError, match="impl"):
        ops.sparse_attention(*args, impl="cuda")
    with pytest.raises(ValueError, match="sink"):
        ops.sparse_attention(args[0], args[1][:1], *args[2:])
    with pytest.raises(ValueError, match="main_scale"):
        ops.sparse_attention(*args[:3], args[3][:, :, :1], *args[4:], impl="pallas")
    with pytest.raises(ValueError, match="block_k"):
        pk_sparse.sparse_attention(*args, block_k=12)


def test_kernels_lower_through_triton():
    """Pallas → Triton IR at real V4.1 dims, lowered for CUDA on this CPU host (no PTX compile)."""
    sd = jax.ShapeDtypeStruct
    b, s, h, d, n, m, k, win = 1, 1, 64, 512, 1024, 136, 512, 128
    attn = (sd((b, s, h, d), jnp.float32), sd((h,), jnp.float32), sd((b, n, d // 2), jnp.uint8),
            sd((b, n, d // 16), jnp.float8_e4m3fn), sd((b, s, k), jnp.int32), sd((b, m, d), jnp.float8_e4m3fn),
            sd((b, m, d // 32), jnp.float8_e8m0fnu), sd((b, s, win), jnp.int32))
    q, w = sd((b, s, 32, 128), jnp.float32), sd((b, s, 32), jnp.float32)
    ikey, iscale, vis = sd((b, n, 64), jnp.uint8), sd((b, n, 4), jnp.float8_e8m0fnu), sd((b, s), jnp.int32)
    traced = [
        pk_sparse._sparse_attention.trace(*attn, interpret=False, block_h=16, block_k=64, block_w=32, num_splits=4,
                                          num_warps=4),
        pk_indexer._indexer_scores.trace(q, w, ikey, iscale, vis, interpret=False, block_s=8, block_n=128,
                                         num_warps=4),
        pk_indexer._indexer_scores_gathered.trace(q, w, ikey, iscale, sd((b, s, 2048), jnp.int32), vis,
                                                  interpret=False, block_p=128, num_warps=4),
        pk_indexer._block_max.trace(sd((b, s, n), jnp.float32), block=8, interpret=False, block_s=8, block_b=128,
                                    num_warps=4),
    ]
    for t in traced:
        assert "__gpu$xla.gpu.triton" in t.lower(lowering_platforms=("cuda",)).as_text()
