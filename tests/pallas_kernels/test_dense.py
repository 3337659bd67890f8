"""`impl="dense"`'s sparse attention (`pallas_kernels.dense`): the reference's semantics read densely.

The shared backend tests (`test_sparse_attention.py`, every `ops.IMPLS`) already hold it to the reference and the
numpy oracle on their cases; here: that those cases take the dense read, repeated ids count as often as the
reference gathers them (and a mutant that counts each listed entry once is caught), the gradients, the blocks of
queries, and the fallback to the reference where gathering reads less."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dense, ops, reference
from tests.pallas_kernels.cases import (
    ATTENTION_CASES,
    TOL,
    attention_case,
    attention_grads,
    check_same_grads,
    np_sparse_attention,
)


def _repeated_ids_case(seed=21, **packed):
    """The chunk case with every query listing its three smallest valid ids twice more (K grows by 6)."""
    args, _ = attention_case(seed, **ATTENTION_CASES["chunk"], **packed)
    q, sink, main, main_idx, win, win_idx = args
    first = jnp.sort(jnp.where(main_idx >= 0, main_idx, 2 ** 30), axis=-1)[..., :3]
    first = jnp.where(first < main.rows, first, -1)
    idx = jnp.concatenate([main_idx, first, first], axis=-1)
    return q, sink, main, idx, win, win_idx


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_the_shared_cases_take_the_dense_read(case):
    q, _, main, main_idx, _, _ = attention_case(1, **ATTENTION_CASES[case])[0]
    assert dense.reads_densely(q, main, main_idx)


def test_multiplicity_counts_each_listing():
    idx = jnp.asarray([[[2, 2, -1, 0, 5, 2], [7, 1, 1, -3, 4, 6]]], jnp.int32)  # rows = 5: 5, 7, 6 are not listed
    want = np.zeros((1, 2, 5), np.float32)
    for s, ids in enumerate(np.asarray(idx[0])):
        for i in ids:
            if 0 <= i < 5:
                want[0, s, i] += 1
    np.testing.assert_array_equal(dense.multiplicity(idx, 5), want)


_multiplicity = dense.multiplicity  # the real one, for the mutant below


def test_repeated_ids_weigh_as_often_as_gathered(monkeypatch):
    args = _repeated_ids_case()
    want = np_sparse_attention(args)
    np.testing.assert_allclose(ops.sparse_attention(*args, impl="dense"), want, **TOL)
    np.testing.assert_allclose(reference.sparse_attention(*args), want, **TOL)
    # The mutant: a top-k *set* (each listed entry once) reads other values on these rows.
    monkeypatch.setattr(dense, "multiplicity", lambda idx, rows: jnp.minimum(_multiplicity(idx, rows), 1.0))
    mutant = np.asarray(dense.sparse_attention.__wrapped__(*args))
    assert not np.allclose(mutant, want, **TOL)


@pytest.mark.parametrize("args", [
    _repeated_ids_case(22, packed_main=False, packed_win=False),
    attention_case(23, **ATTENTION_CASES["decode"], packed_win=False)[0],  # packed main: its bits get float0
], ids=["chunk", "decode"])
def test_gradient_is_the_reference_gradient(args):
    """d/dq, d/dsink and d/d(float payloads) equal the reference's, repeated and out-of-range ids included."""
    q, sink, main, main_idx, win, win_idx = args
    args = (q, sink, main, main_idx.at[0, 0, :2].set(jnp.array([main.rows, -1], jnp.int32)), win, win_idx)
    r = jnp.asarray(np.random.default_rng(7).standard_normal(args[0].shape), jnp.float32)
    check_same_grads(attention_grads(reference.sparse_attention, args, r),
                     attention_grads(dense.sparse_attention, args, r))


def test_blocks_of_queries_read_the_same():
    """Under a small `block_elements` the queries run in several blocks (each rematerialized)."""
    args = _repeated_ids_case(24)
    whole = dense.sparse_attention(*args)
    per_query = 4 * (2 * args[2].rows + args[5].shape[2]) + args[2].rows + args[5].shape[2] * 64
    assert reference.query_block(2, 3, per_query, block_elements=2 * per_query) == 1
    np.testing.assert_allclose(dense.sparse_attention(*args, block_elements=2 * per_query), whole, rtol=1e-6,
                               atol=1e-6)


def test_gathering_runs_where_it_reads_less(monkeypatch):
    """H·N > K·D (few ids into a long buffer, as in decode against a long cache): the reference, bit for bit."""
    args, _ = attention_case(25, **dict(ATTENTION_CASES["decode"], n=200, k=3))
    q, _, main, main_idx, _, _ = args
    assert not dense.reads_densely(q, main, main_idx)
    np.testing.assert_array_equal(dense.sparse_attention(*args), reference.sparse_attention(*args))
