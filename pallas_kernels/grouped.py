"""The MoE's grouped matmul in tiles, in plain XLA: the `"tiled"` implementation of `ops.ragged_dot`.

Rows sorted by group are laid out in tiles of `tile_rows` rows, each group padded to whole tiles, so every tile
belongs to one group; a batched matmul multiplies each tile by its group's matrix. The work is the routed
rows' (plus the padding, about an eighth), not every group's: XLA's `lax.ragged_dot` computes every group
densely outside TPU. With few rows per group (decode) tiles of one row would gather a matrix per row, so
`ops.ragged_dot(..., impl="auto")` keeps the reference there.

Each tile reads its group's matrix, so the tiles run in blocks (`tiles_per_block`): a block gathers at most
`BLOCK_ELEMENTS` matrix elements, blocks run one after another (`lax.scan`), and the backward pass gathers a
block's matrices again rather than keeping them (`jax.checkpoint`). Memory is then the routed rows' plus one
block's matrices, whatever the number of groups and tiles: at the released MoE's size (384 experts of
5120 × 2304, 4096 tokens × 6 slots) gathering every tile's matrix at once would hold 1,896 of them (44 GB in
bfloat16) per weight and layer. A small MoE fits in one block, computed exactly as one batched matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

BLOCK_ELEMENTS = 1 << 26  # matrix elements one block of tiles gathers (128 MB in bfloat16)


def tile_rows(rows: int, groups: int) -> int:
    """Rows per tile: a power of two near a quarter of the mean group size (1 … 128), so padding each group to
    whole tiles wastes about an eighth of the rows and the per-tile matrix gather stays small next to the tile's
    matmul."""
    mean_quarter = max(1, rows // (4 * groups))
    return min(128, 1 << (mean_quarter.bit_length() - 1))


def ragged_dot(lhs: Array, rhs: Array, group_sizes: Array, tile: int | None = None) -> Array:
    """`lhs [M, K]` (rows sorted by group, `group_sizes [G]` rows per group) times each row's `rhs [G, K, N]`;
    rows past `Σ group_sizes` → 0. Accumulates in float32 → `[M, N]` float32. `tile`: rows per tile (default
    `tile_rows(M, G)`)."""
    m_rows, g = lhs.shape[0], group_sizes.shape[0]
    if m_rows == 0:
        return jnp.zeros((0, rhs.shape[2]), jnp.float32)
    m = tile_rows(m_rows, g) if tile is None else tile
    n_tiles = (m_rows + (m - 1) * min(g, m_rows)) // m  # Σ ceil(size/m) over the non-empty groups, at most
    block = tiles_per_block(n_tiles, rhs.shape[1] * rhs.shape[2])
    n_blocks = -(-n_tiles // block)
    slots = n_blocks * block * m  # tile rows, in whole blocks
    tiles = (group_sizes + m - 1) // m
    tile_end = jnp.cumsum(tiles)
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(m_rows), side="right")  # each row's group; G past the last
    start = ends - group_sizes
    grouped = group < g
    at = jnp.minimum(group, g - 1)
    dest = jnp.where(grouped, (tile_end - tiles)[at] * m + jnp.arange(m_rows) - start[at], slots)
    padded = jnp.zeros((slots, lhs.shape[1]), lhs.dtype).at[dest].set(lhs, mode="drop", unique_indices=True)
    tile_group = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n_blocks * block), side="right"), g - 1)

    @jax.checkpoint  # the backward pass gathers the block's matrices again instead of keeping them
    def one_block(x, groups):  # x [block, m, K], groups [block] → [block, m, N]
        return jnp.einsum("tmk,tkn->tmn", x, rhs[groups], preferred_element_type=jnp.float32)

    xs = (padded.reshape(n_blocks, block, m, -1), tile_group.reshape(n_blocks, block))
    if n_blocks == 1:
        out = one_block(*jax.tree.map(lambda a: a[0], xs))
    else:
        out = jax.lax.scan(lambda carry, x: (carry, one_block(*x)), None, xs)[1]
    return jnp.take(out.reshape(slots, -1), dest, axis=0, mode="fill", fill_value=0.0)


def tiles_per_block(n_tiles: int, matrix_elements: int) -> int:
    """Tiles a block holds: as many as gather at most `BLOCK_ELEMENTS` matrix elements (at least one), blocks of
    equal size so the last one pads the fewest tiles."""
    most = max(1, BLOCK_ELEMENTS // matrix_elements)
    n_blocks = -(-n_tiles // most)
    return -(-n_tiles // n_blocks)
