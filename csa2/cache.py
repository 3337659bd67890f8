"""Encoding and position-keyed writes of the state buffers (DESIGN §2).

Values are stored as `pallas_kernels.stored.Stored` entries: packed in their SPEC §8 format, or
float32 (fake-quantized when the caller runs SPEC numerics). Ring buffers keep position `p` at
slot `p % slots`; a write of a chunk keeps exactly its newest `slots` valid positions, so slots
are unique, and an invalid write is dropped, never clipped onto a valid slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from csa2.quant import fake_quant
from pallas_kernels.stored import Stored

Array = jax.Array


def encode(x: Array, like: Stored, quantize: bool) -> Stored:
    """Values `x [..., D]` as entries of `like`'s format and storage: packed, or float32 (fake-quantized
    with a straight-through gradient if `quantize`)."""
    if like.packed:
        return Stored.quantized(x, like.fmt)
    x = x.astype(jnp.float32)
    return Stored(fake_quant(x, like.fmt) if quantize else x, None, like.fmt)


def ring_slots(positions: Array, valid: Array, new_length: Array, slots: int) -> tuple[Array, Array]:
    """Slot `p % slots` of each position `[B, S]`, and which positions to write: the valid ones among the
    last `slots` before `new_length [B]`."""
    keep = valid & (positions >= new_length[:, None] - slots)
    return positions % slots, keep


def ring_scatter(buf: Array, positions: Array, values: Array, valid: Array, new_length: Array) -> Array:
    """A plain ring `buf [B, slots, ...]` with `values [B, S, ...]` written at their positions' slots."""
    slots = buf.shape[1]
    if slots == 0:
        return buf
    slot, keep = ring_slots(positions, valid, new_length, slots)
    idx = jnp.where(keep, slot, slots)  # out of bounds → dropped
    return buf.at[jnp.arange(buf.shape[0])[:, None], idx].set(values.astype(buf.dtype), mode="drop")
