"""Reading and writing the position-keyed state buffers (DESIGN §2, §4).

Stored values are either a packed (payload, scales) pair in a SPEC §8 format or float32 with
`scales=None`. Reads gather first and dequantize after the gather, so a selected set of entries
is never materialized as a new cache. Writes are per row, masked: an invalid write is dropped,
never clipped onto a valid slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from csa2 import quant

Array = jax.Array


def encode(x: Array, fmt: quant.QuantFormat, packed: bool, quantize: bool) -> tuple[Array, Array | None]:
    """Values `x [..., D]` as stored: packed (payload, scales), or float32 (fake-quantized if `quantize`)."""
    if packed:
        return quant.quantize(x, fmt)
    x = x.astype(jnp.float32)
    return (quant.fake_quant(x, fmt) if quantize else x), None


def decode(data: Array, scales: Array | None, fmt: quant.QuantFormat) -> Array:
    """Float32 values of stored entries (dequantize when packed)."""
    return data.astype(jnp.float32) if scales is None else quant.dequantize(data, scales, fmt)


def _gather_row(buf: Array, idx: Array) -> Array:
    return buf[jnp.clip(idx, 0, buf.shape[0] - 1)]


def gather(data: Array, scales: Array | None, idx: Array, fmt: quant.QuantFormat) -> Array:
    """Entries `idx [B, ...]` of per-row buffers `[B, N, ...]` as float32 `[B, ..., D]`.

    Out-of-range indices (e.g. −1 padding) read entry 0 or N−1: callers mask them.
    """
    rows = jax.vmap(_gather_row)
    return decode(rows(data, idx), None if scales is None else rows(scales, idx), fmt)


def _scatter_row(buf: Array, idx: Array, values: Array) -> Array:
    return buf.at[idx].set(values.astype(buf.dtype), mode="drop")


def scatter(buf: Array, idx: Array, values: Array, valid: Array) -> Array:
    """`buf [B, N, ...]` with `values [B, S, ...]` written at `idx [B, S]` where `valid [B, S]`."""
    idx = jnp.where(valid, idx, buf.shape[1])  # out of bounds → dropped
    return jax.vmap(_scatter_row)(buf, idx, values)


def ring_scatter(buf: Array, positions: Array, values: Array, valid: Array, new_length: Array) -> Array:
    """Write positions into a ring `buf [B, slots, ...]` at slot `pos % slots`.

    Only the last `slots` valid positions before `new_length [B]` are written, so slots are
    unique and a chunk longer than the ring keeps exactly its newest entries.
    """
    slots = buf.shape[1]
    if slots == 0:
        return buf
    keep = valid & (positions >= new_length[:, None] - slots)
    return scatter(buf, positions % slots, values, keep)
