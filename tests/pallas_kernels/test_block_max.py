"""block_max: every backend of `ops.BACKENDS` against `reference` and a numpy oracle (pad with −inf, max
per block), the kernel's block sizes, no gradient, argument checks, lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import indexer as pk_indexer, ops, reference
from tests.pallas_kernels.cases import traced

OP = "block_max"


def _scores(seed, shape):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _oracle(scores, block):
    x = np.asarray(scores)
    b, s, n = x.shape
    blocks = -(-n // block)
    padded = np.pad(x, [(0, 0), (0, 0), (0, blocks * block - n)], constant_values=-np.inf)
    return padded.reshape(b, s, blocks, block).max(-1)


def test_backends_table_covers_every_impl():
    assert set(ops.BACKENDS[OP]) == set(ops.IMPLS)
    assert ops.BACKENDS[OP]["xla"] is reference.block_max


def test_block_max_matches_candidate_blocks():
    rng = np.random.default_rng(6)
    scores = jnp.asarray(rng.standard_normal((2, 3, 37)), jnp.float32).at[0, 0, 30:].set(-jnp.inf)
    want = jnp.pad(scores, [(0, 0), (0, 0), (0, 3)], constant_values=-jnp.inf).reshape(2, 3, 5, 8).max(-1)
    np.testing.assert_array_equal(reference.block_max(scores, 8), want)
    np.testing.assert_array_equal(pk_indexer.block_max(scores, 8, interpret=True, block_s=2, block_b=2), want)


@pytest.mark.parametrize("impl", ops.IMPLS)
@pytest.mark.parametrize("shape,block", [((2, 3, 37), 8), ((2, 3, 37), 16), ((1, 5, 5), 8), ((1, 2, 64), 1)])
def test_matches_reference_and_oracle(impl, shape, block):
    scores = _scores(16, shape).at[0, 0, 30:].set(-jnp.inf)  # a row whose tail block(s) are all −inf
    got = np.asarray(ops.block_max(scores, block, impl=impl))
    assert got.shape == (*shape[:2], -(-shape[2] // block)) and got.dtype == np.float32
    np.testing.assert_array_equal(got, reference.block_max(scores, block))
    np.testing.assert_array_equal(got, _oracle(scores, block))


@pytest.mark.parametrize("block_s,block_b", [(1, 1), (2, 2), (4, 8)])
def test_block_max_pallas_blocks(block_s, block_b):
    scores = _scores(17, (2, 5, 77))
    got = pk_indexer.block_max(scores, 4, interpret=True, block_s=block_s, block_b=block_b)
    np.testing.assert_array_equal(got, _oracle(scores, 4))


@pytest.mark.parametrize("impl", ops.IMPLS)
def test_no_gradient(impl):
    scores = _scores(18, (1, 2, 20))
    g = jax.grad(lambda x: ops.block_max(x, 4, impl=impl).sum())(scores)
    np.testing.assert_array_equal(g, 0.0)


def test_bad_arguments_raise():
    scores = _scores(19, (1, 2, 20))
    with pytest.raises(ValueError, match="impl"):
        ops.block_max(scores, 4, impl="gpu")
    for impl in ops.IMPLS:
        with pytest.raises(ValueError, match="block"):
            ops.block_max(scores, 0, impl=impl)
        with pytest.raises(ValueError, match="scores.shape"):
            ops.block_max(scores[0], 4, impl=impl)
    with pytest.raises(ValueError, match="block=6"):
        pk_indexer.block_max(scores, 6)
    with pytest.raises(ValueError, match="block_b"):
        pk_indexer.block_max(scores, 4, block_b=3)


def test_kernel_lowers_through_triton():
    """Pallas → Triton IR at real V4.1 dims, lowered for CUDA on this CPU host (no PTX compile)."""
    sd = jax.ShapeDtypeStruct
    t = traced(pk_indexer.block_max, sd((1, 1, 1024), jnp.float32), block=8, target="triton", block_s=8, block_b=128,
                                    num_warps=4)
    assert "__gpu$xla.gpu.triton" in t.lower(lowering_platforms=("cuda",)).as_text()


# --- TPU (Mosaic) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,block,block_s,block_b", [((2, 5, 77), 4, 2, 2), ((1, 9, 2000), 8, 8, 128),
                                                          ((1, 1, 3), 8, 8, 128)])
def test_tpu_interpreter_matches_oracle(shape, block, block_s, block_b):
    """Under TPU semantics on CPU (`pltpu.InterpretParams`): odd sizes, more blocks than one program's 128."""
    scores = _scores(19, shape)
    got = pk_indexer.block_max(scores, block, target="tpu_interpret", block_s=block_s, block_b=block_b)
    np.testing.assert_array_equal(got, _oracle(scores, block))


@pytest.mark.parametrize("shape", [(1, 1, 1024), (2, 3, 37), (1, 8, 65536)])
def test_kernel_lowers_through_mosaic(shape):
    """Pallas → Mosaic, lowered for TPU on this CPU host (no TPU compile)."""
    t = traced(pk_indexer.block_max, jax.ShapeDtypeStruct(shape, jnp.float32), block=8, target="mosaic", block_s=8,
                                    block_b=128, num_warps=4)
    assert "tpu_custom_call" in t.lower(lowering_platforms=("tpu",)).as_text()
