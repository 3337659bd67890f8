"""The MoE's grouped matmul in tiles, in plain XLA: the `"tiled"` implementation of `ops.ragged_dot`.

Rows sorted by group are laid out in tiles of `tile_rows` rows, each group padded to whole tiles, so every tile
belongs to one group; one batched matmul multiplies each tile by its group's matrix. The work is the routed
rows' (plus the padding, about an eighth), not every group's: XLA's `lax.ragged_dot` computes every group
densely outside TPU. With few rows per group (decode) tiles of one row would gather a matrix per row, so
`ops.ragged_dot(..., impl="auto")` keeps the reference there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def tile_rows(rows: int, groups: int) -> int:
    """Rows per tile: a power of two near a quarter of the mean group size (1 … 128), so padding each group to
    whole tiles wastes about an eighth of the rows and the per-tile matrix gather stays small next to the tile's
    matmul."""
    mean_quarter = max(1, rows // (4 * groups))
    return min(128, 1 << (mean_quarter.bit_length() - 1))


def ragged_dot(lhs: Array, rhs: Array, group_sizes: Array) -> Array:
    """`lhs [M, K]` (rows sorted by group, `group_sizes [G]` rows per group) times each row's `rhs [G, K, N]`;
    rows past `Σ group_sizes` → 0. Accumulates in float32 → `[M, N]` float32."""
    m_rows, g = lhs.shape[0], group_sizes.shape[0]
    m = tile_rows(m_rows, g)
    n_tiles = (m_rows + (m - 1) * min(g, m_rows)) // m  # Σ ceil(size/m) over the non-empty groups, at most
    tiles = (group_sizes + m - 1) // m
    tile_end = jnp.cumsum(tiles)
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(m_rows), side="right")  # each row's group; G past the last
    start = ends - group_sizes
    grouped = group < g
    at = jnp.minimum(group, g - 1)
    dest = jnp.where(grouped, (tile_end - tiles)[at] * m + jnp.arange(m_rows) - start[at], n_tiles * m)
    padded = jnp.zeros((n_tiles * m, lhs.shape[1]), lhs.dtype).at[dest].set(lhs, mode="drop", unique_indices=True)
    tile_group = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right"), g - 1)
    out = jnp.einsum("tmk,tkn->tmn", padded.reshape(n_tiles, m, -1), rhs[tile_group],
                     preferred_element_type=jnp.float32)
    return jnp.take(out.reshape(n_tiles * m, -1), dest, axis=0, mode="fill", fill_value=0.0)
