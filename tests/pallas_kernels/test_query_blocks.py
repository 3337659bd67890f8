"""The XLA reference's reads in blocks of queries (`reference.by_query_blocks`): the same values and gradients as
one block, a smaller compiled footprint, and the block size the budget allows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from tests.pallas_kernels.cases import attention_case, indexer_case


def test_query_block_is_the_largest_divisor_within_the_budget():
    assert reference.query_block(1, 4096, 1000, block_elements=10_000_000) == 4096  # fits: one block
    assert reference.query_block(1, 4096, 1000, block_elements=100_000) == 64  # 100 fit; 64 divides 4096
    assert reference.query_block(2, 12, 10, block_elements=100) == 4  # 2 rows × 5 queries fit; 4 divides 12
    assert reference.query_block(1, 7, 10, block_elements=30) == 1  # 7 is prime
    assert reference.query_block(4, 8, 10**9, block_elements=1) == 1  # at least one query


def _attention(s):
    args, _ = attention_case(3, b=2, s=s, h=4, d=64, n=40, k=37, window=8, slots=10, starts=[23, 5], floors=[0, 6])
    return args


def _gathered(s):
    return indexer_case(5, b=2, s=s, hi=4, di=64, n=30, pool=21)


def _scores(s):
    q, w, ikey, _, visible = indexer_case(7, b=2, s=s, hi=4, di=64, n=30, pool=1)
    return q, w, ikey, visible


OPS = {  # name → (function, case builder, differentiable argument positions)
    "sparse_attention": (reference.sparse_attention, _attention, (0, 1)),
    "indexer_scores_gathered": (reference.indexer_scores_gathered, _gathered, (0, 1)),
    "indexer_scores": (reference.indexer_scores, _scores, (0, 1)),
}


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("queries_per_block", [1, 3])
def test_blocks_give_the_values_and_gradients_of_one_block(name, queries_per_block):
    fn, case, argnums = OPS[name]
    args = case(6)
    per_query = {"sparse_attention": 45 * (64 + 4), "indexer_scores_gathered": 21 * (64 + 4),
                 "indexer_scores": 30 * (4 + 1)}[name]
    budget = 2 * queries_per_block * per_query  # B = 2 rows
    assert reference.query_block(2, 6, per_query, budget) == queries_per_block
    whole, blocked = fn(*args), fn(*args, block_elements=budget)
    np.testing.assert_allclose(blocked, whole, rtol=1e-6, atol=1e-6)
    weights = jnp.asarray(np.random.default_rng(0).standard_normal(whole.shape), jnp.float32)

    def loss(*diff, block_elements):
        full = list(args)
        for i, x in zip(argnums, diff):
            full[i] = x
        out = fn(*full, block_elements=block_elements)
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0) * weights)

    diff = [args[i] for i in argnums]
    grad = jax.grad(loss, argnums=tuple(range(len(argnums))))
    for a, b in zip(grad(*diff, block_elements=reference.BLOCK_ELEMENTS), grad(*diff, block_elements=budget)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_blocks_shrink_the_compiled_temporaries():
    """At 256 queries of a 512-entry pool the one-block read gathers [2, 256, 512, 64] float32 (32 MiB); blocks of 8
    queries need a thirty-second of that."""
    q, w, ikey, ids, visible = indexer_case(9, b=2, s=256, hi=4, di=64, n=600, pool=512)

    def temp(block_elements):
        lowered = jax.jit(lambda *a: reference.indexer_scores_gathered(*a, block_elements=block_elements)).lower(
            q, w, ikey, ids, visible)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    one, blocked = temp(reference.BLOCK_ELEMENTS), temp(2 * 8 * 512 * (64 + 4))
    assert one >= 2 * 256 * 512 * 64 * 4 and blocked * 8 < one
