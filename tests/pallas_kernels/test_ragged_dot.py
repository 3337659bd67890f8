"""The MoE's grouped matmul op (`ops.ragged_dot`): every implementation of its row of the table against the
reference (`lax.ragged_dot`), forward and both gradients, on groups that are empty, ragged, larger than a tile,
and rows past the groups' sum (→ 0). A planted mutant shows the comparison can fail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped, ops, reference

IMPLS = sorted(ops.BACKENDS["ragged_dot"])
CASES = {  # rows M, K, N, group sizes (Σ ≤ M)
    "decode": (6, 16, 8, (1, 0, 2, 3)),
    "ragged": (50, 8, 3, (10, 0, 25, 9)),  # 6 rows past the groups
    "tiles": (512, 32, 16, (130, 1, 0, 200, 181)),
}


def _case(name):
    m, k, n, sizes = CASES[name]
    rng = np.random.default_rng(len(name))
    return (jnp.asarray(rng.standard_normal((m, k)), jnp.float32),
            jnp.asarray(rng.standard_normal((len(sizes), k, n)), jnp.float32), jnp.asarray(sizes, jnp.int32))


def _error(fn, name) -> float:
    """Worst difference from the reference over the output and the gradients of lhs and rhs."""
    lhs, rhs, sizes = _case(name)
    def loss(f):
        return lambda a, b: jnp.sum(jnp.sin(f(a, b, sizes)))

    got = (fn(lhs, rhs, sizes), *jax.grad(loss(fn), argnums=(0, 1))(lhs, rhs))
    want = (reference.ragged_dot(lhs, rhs, sizes), *jax.grad(loss(reference.ragged_dot), argnums=(0, 1))(lhs, rhs))
    return max(float(jnp.max(jnp.abs(g - w))) for g, w in zip(got, want))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("impl", IMPLS)
def test_every_implementation_matches_the_reference(impl, name):
    assert _error(lambda *a: ops.ragged_dot(*a, impl=impl), name) <= 1e-4
    lhs, rhs, sizes = _case(name)
    past = int(np.sum(sizes))
    assert not np.any(np.asarray(ops.ragged_dot(lhs, rhs, sizes, impl=impl))[past:])  # rows past the groups: 0


def test_tiles_in_several_blocks_match_the_reference(monkeypatch):
    """Blocks of 5 tiles: scanned blocks, the last one padded, the backward pass gathering each block's matrices
    again, still the reference's values and gradients; no rows, no output."""
    lhs, rhs, sizes = _case("tiles")
    monkeypatch.setattr(grouped, "BLOCK_ELEMENTS", 5 * rhs.shape[1] * rhs.shape[2])
    m = grouped.tile_rows(lhs.shape[0], sizes.shape[0])
    n_tiles = (lhs.shape[0] + (m - 1) * sizes.shape[0]) // m
    assert grouped.tiles_per_block(n_tiles, rhs.shape[1] * rhs.shape[2]) == 5 and n_tiles % 5  # blocks, one padded
    assert _error(grouped.ragged_dot, "tiles") <= 1e-4
    assert grouped.tiles_per_block(10, 1 << 30) == 1 and grouped.tiles_per_block(10, 1) == 10
    assert grouped.ragged_dot(lhs[:0], rhs, sizes * 0).shape == (0, rhs.shape[2])


def test_auto_tiles_large_groups_only():
    assert ops.ragged_dot_impl(6, 4) == "xla" and ops.ragged_dot_impl(512, 5) == "tiled"
    assert grouped.tile_rows(512, 5) == 16 and grouped.tile_rows(6, 4) == 1
    with pytest.raises(ValueError, match=r"impl='pallas'; use one of \('xla', 'tiled', 'auto'\)"):
        ops.ragged_dot(*_case("decode"), impl="pallas")


def test_a_tile_of_the_wrong_group_is_caught():
    """Mutant: each tile multiplied by the next group's matrix (an off-by-one in the tile → group map)."""
    def shifted(lhs, rhs, sizes):
        return grouped.ragged_dot(lhs, jnp.roll(rhs, 1, axis=0), sizes)
    err = _error(shifted, "tiles")
    print(f"\nmutant shifted groups: {err:.3g}")
    assert err > 1.0
