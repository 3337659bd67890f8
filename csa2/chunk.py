"""Where a chunk of tokens sits in each row: the coordinates every layer of one call shares (DESIGN §2).

Prefill chunks, decode steps (S = 1) and verify blocks (S = γ + 1) are all chunks: `S` tokens per
row at positions `start + j`, of which the first `n_valid` are real; the rest is padding that
writes nothing anyone can read.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


@chex.dataclass(frozen=True)
class Chunk:
    """Rows' first position `start [B]`, real tokens `n_valid [B]`, and the replay `floor [B]` below
    which no window entry is visible (SPEC §11; 0 = no floor)."""

    start: Array
    n_valid: Array
    floor: Array

    def positions(self, s: int) -> Array:
        return self.start[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]  # [B, S]

    def valid(self, s: int) -> Array:
        return jnp.arange(s, dtype=jnp.int32)[None, :] < self.n_valid[:, None]  # [B, S]

    @property
    def end(self) -> Array:
        """Length of each row once the chunk is written: `start + n_valid` [B]."""
        return self.start + self.n_valid


def take_rows(x: Array, rows: Array) -> Array:
    """x [B, S, ...] → x[b, rows[b, j]] [B, T, ...]: the chunk rows `rows [B, T]` of each batch row."""
    return jax.vmap(lambda a, i: a[i])(x, rows)
