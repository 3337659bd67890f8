"""sparse_attention: every backend of `ops.BACKENDS` against `reference` and an independent numpy oracle,
the Pallas kernel's own block / split / head-block parameters, argument checks, gradient, Triton lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ops, reference, sparse_attention as pk_sparse
from pallas_kernels.formats import MAIN, WINDOW
from pallas_kernels.stored import Stored
from tests.pallas_kernels.cases import (
    ATTENTION_CASES,
    TOL,
    attention_case,
    attention_grads,
    check_same_grads,
    empty_rows,
    np_entries,
    np_gather,
    np_sink_attention,
    np_sparse_attention,
    traced,
)

OP = "sparse_attention"


def _run(impl, args):
    return np.asarray(ops.sparse_attention(*args, impl=impl))


def _check_empty_rows_zero(got, args):
    main, main_idx, win, win_idx = args[2:]
    empty = empty_rows(main_idx, main.rows, win_idx, win.rows)
    assert np.all(got[empty] == 0)


def test_backends_table_covers_every_impl():
    assert set(ops.BACKENDS[OP]) == set(ops.IMPLS)
    assert ops.BACKENDS[OP]["xla"] is reference.sparse_attention


@pytest.mark.parametrize("impl", ops.IMPLS)
def test_oracle_window_first_with_unmasked_ids(impl):
    """The old csa2 comparison: keys = [window rows at the unmasked ids, main rows], validity from the
    window floor / fill and main ids ≥ 0, one sink softmax (order of the sources does not matter)."""
    args, (_, ids, win_valid) = attention_case(1, **ATTENTION_CASES["chunk"])
    q, sink, main, main_idx, win, _ = args
    win_keys, _ = np_gather(np_entries(win), ids)
    main_keys, _ = np_gather(np_entries(main), main_idx)
    keys = np.concatenate([win_keys, main_keys], axis=2)
    valid = np.concatenate([win_valid, np.asarray(main_idx) >= 0], axis=2)
    want = np_sink_attention(q, keys, valid, sink)
    got = _run(impl, args)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(got, reference.sparse_attention(*args), **TOL)


@pytest.mark.parametrize("impl", ops.IMPLS)
@pytest.mark.parametrize("case,packed", [
    ("chunk", dict()),
    ("chunk", dict(packed_main=False)),
    ("decode", dict(packed_win=False)),
    ("decode", dict(packed_main=False, packed_win=False)),
])
def test_matches_reference_and_oracle(impl, case, packed):
    args, _ = attention_case(2, **ATTENTION_CASES[case], **packed)
    got = _run(impl, args)
    assert got.dtype == np.float32 and got.shape == args[0].shape
    np.testing.assert_allclose(got, reference.sparse_attention(*args), **TOL)
    np.testing.assert_allclose(got, np_sparse_attention(args), **TOL)
    _check_empty_rows_zero(got, args)


@pytest.mark.parametrize("impl", ops.IMPLS)
def test_all_invalid_and_empty_sources(impl):
    args, _ = attention_case(3, **ATTENTION_CASES["decode"])
    q, sink, main, main_idx, win, win_idx = args
    none = jnp.full_like(win_idx, -1)
    out = ops.sparse_attention(q, sink, main, jnp.full_like(main_idx, -1), win, none, impl=impl)
    assert np.all(np.asarray(out) == 0)
    # SWA-only layer: no Global ids at all.
    no_main = main_idx[..., :0]
    only_win = (q, sink, main, no_main, win, win_idx)
    got = _run(impl, only_win)
    np.testing.assert_allclose(got, reference.sparse_attention(*only_win), **TOL)
    np.testing.assert_allclose(got, np_sparse_attention(only_win), **TOL)


@pytest.mark.parametrize("impl", ops.IMPLS)
def test_ids_at_or_beyond_rows_are_skipped(impl):
    """main ids ≥ N and window ids ≥ M count as −1 (never clipped onto the last row)."""
    args, _ = attention_case(4, **ATTENTION_CASES["chunk"])
    q, sink, main, main_idx, win, win_idx = args
    main_idx = main_idx.at[0, 0, :5].set(jnp.array([main.rows, main.rows + 7, -1, -5, 2 ** 30], jnp.int32))
    win_idx = win_idx.at[1, 2, :2].set(win.rows)
    args = (q, sink, main, main_idx, win, win_idx)
    got = _run(impl, args)
    np.testing.assert_allclose(got, reference.sparse_attention(*args), **TOL)
    np.testing.assert_allclose(got, np_sparse_attention(args), **TOL)
    # the same as dropping them to −1
    dropped = (q, sink, main, jnp.where(main_idx >= main.rows, -1, main_idx), win,
               jnp.where(win_idx >= win.rows, -1, win_idx))
    np.testing.assert_allclose(got, _run(impl, dropped), **TOL)


# --- the Pallas kernel's own parameters -------------------------------------------------------------

@pytest.mark.parametrize("case,kwargs", [
    ("chunk", dict(block_k=16, block_w=4)),
    ("chunk", dict(block_k=8, block_w=8, num_splits=2, packed_main=False)),
    ("decode", dict(block_k=4, block_w=4, num_splits=3, packed_win=False)),
])
def test_sparse_attention_pallas_blocks_match_reference(case, kwargs):
    packed = {key: kwargs.pop(key) for key in ("packed_main", "packed_win") if key in kwargs}
    args, _ = attention_case(2, **ATTENTION_CASES[case], **packed)
    want = reference.sparse_attention(*args)
    got = np.asarray(pk_sparse.sparse_attention(*args, interpret=True, **kwargs))
    np.testing.assert_allclose(got, want, **TOL)
    _check_empty_rows_zero(got, args)


def test_head_padding():
    """H = 5 with block_h = 4 (heads padded to 8) and K = 37 with block_k = 16 (ids padded with −1)."""
    shape = dict(ATTENTION_CASES["chunk"], h=5)
    args, _ = attention_case(5, **shape)
    got = pk_sparse.sparse_attention(*args, interpret=True, block_h=4, block_k=16, block_w=4, num_splits=2)
    np.testing.assert_allclose(got, reference.sparse_attention(*args), **TOL)
    np.testing.assert_allclose(got, np_sparse_attention(args), **TOL)


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
    args, _ = attention_case(seed, **shape, packed_main=bool(rng.integers(2)))
    kwargs = dict(block_k=int(rng.choice([4, 8, 16])), block_w=int(rng.choice([2, 4])),
                  num_splits=int(rng.integers(1, 4)), block_h=int(rng.choice([1, 2, 4])))
    np.testing.assert_allclose(pk_sparse.sparse_attention(*args, interpret=True, **kwargs),
                               reference.sparse_attention(*args), **TOL, err_msg=f"{shape} {kwargs}")


# --- the TPU form: SMEM ids, row DMAs, double-buffered VMEM (TPU interpreter on CPU; Mosaic lowering) -----

def _tpu(args, block_k=8, block_w=8, num_splits=None):
    return np.asarray(pk_sparse.sparse_attention(*args, target="tpu_interpret", block_h=None, block_k=block_k,
                                                 block_w=block_w, num_splits=num_splits, num_warps=4))


@pytest.mark.parametrize("case,kwargs", [
    ("chunk", dict()),  # H = 4 padded to 8; K = 37 padded to 40 with −1; wrapped ring, replay floor
    ("chunk", dict(block_k=16, num_splits=2, packed_main=False)),
    ("decode", dict(packed_win=False, num_splits=3)),
    ("decode", dict(packed_main=False, packed_win=False, block_w=16)),
])
def test_tpu_form_matches_reference_and_oracle(case, kwargs):
    packed = {key: kwargs.pop(key) for key in ("packed_main", "packed_win") if key in kwargs}
    args, _ = attention_case(8, **ATTENTION_CASES[case], **packed)
    got = _tpu(args, **kwargs)
    np.testing.assert_allclose(got, reference.sparse_attention(*args), **TOL)
    np.testing.assert_allclose(got, np_sparse_attention(args), **TOL)
    _check_empty_rows_zero(got, args)


def test_tpu_form_lone_decode_row_splits_in_two():
    """One decode row (B = S = 1): the default splits its entries across the two TensorCores; a split whose
    ids are all −1 padding starts no DMA and contributes nothing."""
    shape = dict(ATTENTION_CASES["decode"], b=1, starts=[17], floors=[15])
    args, _ = attention_case(9, **shape)
    np.testing.assert_allclose(_tpu(args), reference.sparse_attention(*args), **TOL)
    np.testing.assert_allclose(_tpu(args, block_k=16, num_splits=4), reference.sparse_attention(*args), **TOL)


def test_tpu_form_invalid_ids_and_empty_sources():
    """−1 and ≥ rows ids start no DMA (their slot rows keep finite stale data, masked out); an all-invalid row
    gives 0; an SWA-only layer (no main ids) runs on a dummy source."""
    args, _ = attention_case(10, **ATTENTION_CASES["chunk"])
    q, sink, main, main_idx, win, win_idx = args
    main_idx = main_idx.at[0, 0, :4].set(jnp.array([main.rows, -1, 2 ** 30, -7], jnp.int32))
    win_idx = win_idx.at[1, 2, :2].set(win.rows)
    args = (q, sink, main, main_idx, win, win_idx)
    np.testing.assert_allclose(_tpu(args), np_sparse_attention(args), **TOL)
    none = (q, sink, main, jnp.full_like(main_idx, -1), win, jnp.full_like(win_idx, -1))
    assert np.all(_tpu(none) == 0)
    only_win = (q, sink, main, main_idx[..., :0], win, win_idx)
    np.testing.assert_allclose(_tpu(only_win), np_sparse_attention(only_win), **TOL)


@pytest.mark.parametrize("s,k,packed_main,num_splits", [(1, 512, True, None), (16, 512, True, 1),
                                                         (1, 512, False, None)])
def test_tpu_form_lowers_through_mosaic(s, k, packed_main, num_splits):
    """Pallas → Mosaic at real V4.1 dims (H 64, D 512, top-k 512, window 128), lowered for TPU on this CPU host:
    decode (a lone row: two splits), a prefill chunk, and the float (QAT) Global KV."""
    sd = jax.ShapeDtypeStruct
    b, h, d, n, m = 1, 64, 512, 1024, 136
    main = (Stored(sd((b, n, d // 2), jnp.uint8), sd((b, n, d // 16), jnp.float8_e4m3fn), MAIN) if packed_main
            else Stored(sd((b, n, d), jnp.float32), None, MAIN))
    window = Stored(sd((b, m, d), jnp.float8_e4m3fn), sd((b, m, d // 32), jnp.float8_e8m0fnu), WINDOW)
    t = traced(pk_sparse.sparse_attention, sd((b, s, h, d), jnp.float32), sd((h,), jnp.float32), main,
                                          sd((b, s, k), jnp.int32), window, sd((b, s, 128), jnp.int32),
                                          target="mosaic", block_h=None, block_k=128, block_w=128,
                                          num_splits=num_splits, num_warps=4)
    text = t.lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1 and "csa2_sparse_attention_tpu" in text


# --- gradient: the backward kernel -------------------------------------------------------------------

@pytest.mark.parametrize("case,packed,kwargs", [
    ("chunk", dict(packed_main=False, packed_win=False), dict()),
    ("chunk", dict(packed_main=False, packed_win=True), dict(block_h=2, block_k=8, block_w=4)),  # 2 head blocks
    ("decode", dict(packed_main=True, packed_win=False), dict(block_k=4, num_splits=2)),
])
def test_backward_kernel_is_the_reference_gradient(case, packed, kwargs):
    """Sparse attention's custom VJP (the backward kernel from the saved log-normalizer, d kv added into the
    selected rows): d/dq, d/dsink and d/d(float payloads) equal the reference's; packed bits get float0."""
    args, _ = attention_case(6, **ATTENTION_CASES[case], **packed)
    main_idx = args[3].at[0, 0, :3].set(jnp.array([args[2].rows, -1, 0], jnp.int32))  # an id ≥ N; −1
    args = (*args[:3], main_idx, *args[4:])
    r = jnp.asarray(np.random.default_rng(7).standard_normal(args[0].shape), jnp.float32)
    check_same_grads(attention_grads(reference.sparse_attention, args, r),
                     attention_grads(functools.partial(pk_sparse.sparse_attention, interpret=True, **kwargs), args, r))


def test_tpu_backward_kernel_is_the_reference_gradient():
    """The TPU form of the backward (rows by DMA, as in the forward) under the TPU interpreter."""
    for case, packed in (("chunk", dict(packed_main=False, packed_win=False)),
                         ("decode", dict(packed_main=True, packed_win=False))):
        args, _ = attention_case(6, **ATTENTION_CASES[case], **packed)
        r = jnp.asarray(np.random.default_rng(7).standard_normal(args[0].shape), jnp.float32)
        want = attention_grads(reference.sparse_attention, args, r)
        got = attention_grads(functools.partial(pk_sparse.sparse_attention, target="tpu_interpret", block_k=8,
                                                block_w=8), args, r)
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            if w.dtype != jax.dtypes.float0:
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=case)


@pytest.mark.parametrize("target,platform,marker", [("triton", "cuda", "__gpu$xla.gpu.triton"),
                                                    ("mosaic", "tpu", "csa2_sparse_attention_bwd_tpu")])
def test_backward_kernel_lowers(target, platform, marker):
    """The backward kernel → Triton IR / Mosaic at V4.1 dims on the float (QAT) buffers training uses."""
    sd = jax.ShapeDtypeStruct
    b, s, h, d, n, m, k, win = 1, 4, 64, 512, 1024, 136, 512, 128
    f = sd((b, s, h, d), jnp.float32)
    def loss(q, *rest):  # the backward kernel runs in the gradient of the op
        out = pk_sparse.sparse_attention(q, *rest, target=target, block_h=16, block_k=32, block_w=32, num_warps=4)
        return jnp.sum(out * out)

    t = jax.jit(jax.grad(loss)).trace(f, sd((h,), jnp.float32), Stored(sd((b, n, d), jnp.float32), None, MAIN),
                                      sd((b, s, k), jnp.int32), Stored(sd((b, m, d), jnp.float32), None, WINDOW),
                                      sd((b, s, win), jnp.int32))
    assert marker in t.lower(lowering_platforms=(platform,)).as_text()


# --- dispatch, checks, lowering -----------------------------------------------------------------

def test_bad_arguments_raise():
    args, _ = attention_case(7, **ATTENTION_CASES["decode"])
    q, sink, main, main_idx, win, win_idx = args
    with pytest.raises(ValueError, match="impl"):
        ops.sparse_attention(*args, impl="cuda")
    with pytest.raises(ValueError, match="sink"):
        ops.sparse_attention(q, sink[:1], *args[2:])
    bad_scale = Stored(main.payload, main.scale[:, :, :1], MAIN)
    with pytest.raises(ValueError, match=r"main\.scale"):
        ops.sparse_attention(q, sink, bad_scale, *args[3:], impl="pallas")
    with pytest.raises(ValueError, match=r"main\.scale"):
        ops.sparse_attention(q, sink, bad_scale, *args[3:], impl="xla")
    with pytest.raises(ValueError, match="main_idx"):
        ops.sparse_attention(q, sink, main, main_idx[..., 0], win, win_idx, impl="pallas")
    with pytest.raises(ValueError, match="window"):
        ops.sparse_attention(q, sink, main, main_idx, Stored(win.payload, win.scale, MAIN), win_idx, impl="pallas")
    with pytest.raises(ValueError, match="block_k"):
        pk_sparse.sparse_attention(*args, block_k=12)


def test_kernel_lowers_through_triton():
    """Pallas → Triton IR at real V4.1 dims, lowered for CUDA on this CPU host (no PTX compile)."""
    sd = jax.ShapeDtypeStruct
    b, s, h, d, n, m, k, win = 1, 1, 64, 512, 1024, 136, 512, 128
    main = Stored(sd((b, n, d // 2), jnp.uint8), sd((b, n, d // 16), jnp.float8_e4m3fn), MAIN)
    window = Stored(sd((b, m, d), jnp.float8_e4m3fn), sd((b, m, d // 32), jnp.float8_e8m0fnu), WINDOW)
    t = traced(pk_sparse.sparse_attention, sd((b, s, h, d), jnp.float32), sd((h,), jnp.float32), main,
                                          sd((b, s, k), jnp.int32), window, sd((b, s, win), jnp.int32),
                                          target="triton", block_h=16, block_k=64, block_w=32, num_splits=4,
                                          num_warps=4)
    assert "__gpu$xla.gpu.triton" in t.lower(lowering_platforms=("cuda",)).as_text()


def test_triton_entry_blocks_fit_shared_memory():
    """On an H200 the default block of 64 entries at D = 512 asked Triton for 288 KiB of shared memory (refused:
    227 KiB). The GPU block now keeps the float32 head rows and the decoded block (twice) under 160 KiB, so it
    also fits an A100; other targets keep the block asked for."""
    assert pk_sparse.entry_block("triton", 512, 64, 1, 512, 16) == 32  # forward: q rows
    assert pk_sparse.entry_block("triton", 512, 64, 1, 512, 32) == 16  # backward: q and dO rows
    assert pk_sparse.entry_block("triton", 512, 64, 1, 128, 16) == 64  # a narrower latent keeps its block
    assert pk_sparse.entry_block("interpret", 512, 64, 1, 512, 64) == 64
    for d, rows in ((512, 16), (512, 32), (256, 64)):
        blk = pk_sparse.entry_block("triton", 4096, 128, 1, d, rows)
        assert 4 * d * (rows + 2 * blk) <= 160 * 1024
