"""indexer_scores: every backend of `ops.BACKENDS` against `reference` and an independent numpy oracle
(Σ_h w_h·relu(q_h·k), −inf beyond `visible`), the kernel's block sizes, argument checks, gradient, lowering."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import indexer as pk_indexer, ops, reference
from pallas_kernels.formats import INDEX, MAIN
from pallas_kernels.stored import Stored
from tests.pallas_kernels.cases import (
    TOL,
    check_score_grads,
    check_scores,
    indexer_case,
    np_entries,
    np_index_scores,
    same_topk,
    traced,
)

OP = "indexer_scores"


def _oracle(q, w, ikey, visible):
    n = ikey.rows
    seen = np.arange(n) < np.asarray(visible)[..., None]
    return np.where(seen, np_index_scores(q, w, np_entries(ikey)), -np.inf), seen


def test_backends_table_covers_every_impl():
    assert set(ops.BACKENDS[OP]) == set(ops.IMPLS)
    assert ops.BACKENDS[OP]["xla"] is reference.indexer_scores


@pytest.mark.parametrize("impl", ops.IMPLS)
@pytest.mark.parametrize("packed,n", [(True, 37), (False, 64), (True, 1)])
def test_matches_reference_and_oracle(impl, packed, n):
    q, w, ikey, _, visible = indexer_case(4, b=2, s=3, hi=4, di=64, n=n, pool=8, packed=packed)
    want, seen = _oracle(q, w, ikey, visible)
    ref = reference.indexer_scores(q, w, ikey, visible)
    got = ops.indexer_scores(q, w, ikey, visible, impl=impl)
    for x in (ref, got):
        check_scores(x, want, seen)
    np.testing.assert_allclose(got, ref, **TOL)
    same_topk(got, ref, seen, 7)


@pytest.mark.parametrize("impl", ops.IMPLS)
def test_visible_zero_and_all(impl):
    """visible = 0 → every score −inf; visible ≥ N → no −inf."""
    q, w, ikey, _, _ = indexer_case(8, b=2, s=3, hi=2, di=32, n=21, pool=4)
    nothing = jnp.zeros((2, 3), jnp.int32)
    assert np.all(np.isneginf(np.asarray(ops.indexer_scores(q, w, ikey, nothing, impl=impl))))
    everything = jnp.full((2, 3), 21, jnp.int32).at[1, 2].set(50)
    got = ops.indexer_scores(q, w, ikey, everything, impl=impl)
    want, seen = _oracle(q, w, ikey, everything)
    assert seen.all()
    check_scores(got, want, seen)


# --- the Pallas kernel's own parameters -------------------------------------------------------------

@pytest.mark.parametrize("packed,n,block_n", [(True, 37, 16), (False, 64, 32)])
def test_indexer_scores_pallas_blocks(packed, n, block_n):
    q, w, ikey, _, visible = indexer_case(4, b=2, s=3, hi=4, di=64, n=n, pool=8, packed=packed)
    want, seen = _oracle(q, w, ikey, visible)
    ref = reference.indexer_scores(q, w, ikey, visible)
    got = pk_indexer.indexer_scores(q, w, ikey, visible, interpret=True, block_s=2, block_n=block_n)
    for x in (ref, got):
        check_scores(x, want, seen)
    same_topk(got, ref, seen, 7)


@pytest.mark.parametrize("seed", [21, 22])
def test_indexer_scores_random_shapes(seed):
    rng = np.random.default_rng(seed)
    b, s, n, pool = int(rng.integers(1, 3)), int(rng.integers(1, 6)), int(rng.integers(1, 70)), int(rng.integers(1, 30))
    q, w, ikey, _, visible = indexer_case(seed, b=b, s=s, hi=int(rng.integers(1, 5)), di=32, n=n, pool=pool)
    k = int(rng.integers(1, n + 1))
    seen = np.arange(n) < np.asarray(visible)[..., None]
    got = pk_indexer.indexer_scores(q, w, ikey, visible, interpret=True, block_s=int(rng.choice([1, 2, 4])),
                                    block_n=int(rng.choice([8, 16, 64])))
    ref = reference.indexer_scores(q, w, ikey, visible)
    np.testing.assert_allclose(got, ref, **TOL)
    same_topk(got, ref, seen, k)


# --- gradient ---------------------------------------------------------------------------------------

def test_pallas_gradient_is_the_reference_gradient():
    q, w, ikey, _, visible = indexer_case(9, b=2, s=3, hi=4, di=32, n=19, pool=4)
    r = jnp.asarray(np.random.default_rng(10).standard_normal((2, 3, 19)), jnp.float32)
    check_score_grads(lambda q, w, impl: ops.indexer_scores(q, w, ikey, visible, impl=impl), r, q, w)


# --- checks, lowering -------------------------------------------------------------------------------

def test_bad_arguments_raise():
    q, w, ikey, _, visible = indexer_case(11, b=1, s=2, hi=2, di=32, n=8, pool=4)
    with pytest.raises(ValueError, match="impl"):
        ops.indexer_scores(q, w, ikey, visible, impl="triton")
    for impl in ops.IMPLS:
        with pytest.raises(ValueError, match="w.shape"):
            ops.indexer_scores(q, w[..., :1], ikey, visible, impl=impl)
        with pytest.raises(ValueError, match="ikey"):
            ops.indexer_scores(q, w, Stored(ikey.payload, ikey.scale, MAIN), visible, impl=impl)
        with pytest.raises(ValueError, match="visible"):
            ops.indexer_scores(q, w, ikey, visible[..., None], impl=impl)
    with pytest.raises(ValueError, match="block_n"):
        pk_indexer.indexer_scores(q, w, ikey, visible, block_n=24)


def test_kernel_lowers_through_triton():
    """Pallas → Triton IR at real V4.1 dims, lowered for CUDA on this CPU host (no PTX compile)."""
    sd = jax.ShapeDtypeStruct
    b, s, n = 1, 1, 1024
    ikey = Stored(sd((b, n, 64), jnp.uint8), sd((b, n, 4), jnp.float8_e8m0fnu), INDEX)
    t = traced(pk_indexer.indexer_scores, sd((b, s, 32, 128), jnp.float32), sd((b, s, 32), jnp.float32), ikey,
                                         sd((b, s), jnp.int32), target="triton", block_s=8, block_n=128, num_warps=4)
    assert "__gpu$xla.gpu.triton" in t.lower(lowering_platforms=("cuda",)).as_text()


# --- TPU (Mosaic) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("packed,s,n,block_s,block_n", [(True, 3, 37, 2, 16), (False, 5, 300, 8, 128),
                                                         (True, 9, 1, 4, 256)])
def test_tpu_interpreter_matches_reference(packed, s, n, block_s, block_n):
    """The kernel under TPU semantics on CPU (`pltpu.InterpretParams`, Mosaic's block rule): odd S and N, one
    entry, N past one key block, visible 0 … N."""
    q, w, ikey, _, visible = indexer_case(31, b=2, s=s, hi=4, di=64, n=n, pool=8, packed=packed)
    visible = visible.at[0, 0].set(0)
    want, seen = _oracle(q, w, ikey, visible)
    got = pk_indexer.indexer_scores(q, w, ikey, visible, target="tpu_interpret", block_s=block_s, block_n=block_n)
    check_scores(got, want, seen)
    np.testing.assert_allclose(got, reference.indexer_scores(q, w, ikey, visible), **TOL)


@pytest.mark.parametrize("s,n", [(1, 1024), (3, 37), (8, 131072)])
def test_kernel_lowers_through_mosaic(s, n):
    """Pallas → Mosaic at V4.1 dims (32 heads × 128), lowered for TPU on this CPU host (no TPU compile)."""
    sd = jax.ShapeDtypeStruct
    ikey = Stored(sd((1, n, 64), jnp.uint8), sd((1, n, 4), jnp.float8_e8m0fnu), INDEX)
    t = traced(pk_indexer.indexer_scores, sd((1, s, 32, 128), jnp.float32), sd((1, s, 32), jnp.float32), ikey,
                                         sd((1, s), jnp.int32), target="mosaic", block_s=8, block_n=512, num_warps=4)
    assert "tpu_custom_call" in t.lower(lowering_platforms=("tpu",)).as_text()
