"""`Stored`: a buffer of entries in one SPEC §8 format, carried as one pytree value (DESIGN §2, §4).

A `Stored` is the payload, its per-block scales and the static format together: packed
(`MAIN`/`INDEX` e2m1 pairs or `WINDOW` e4m3 payload, with scales) or float32 values with
`scale=None` (QAT and the exact reference). Packed buffers hold raw bytes: payload and scales are
uint8 bit patterns, decoded by `formats.decode_bits` (which reads bits, in the reference and in the
kernels alike). Moving bytes is what storage does; XLA:CPU would otherwise rewrite every gather,
scatter and concatenation of a float8 array into converts of the whole operand through f16. The feature axis is last and
the rows axis before it; leading axes are free (`[B, rows, ·]` for one Global KV source, `[B, L, slots, ·]` for every
layer's SWA ring). Tree maps reach payload and scale together, so slicing, stacking, `fork` and
donation treat a stored buffer as one value, and no `(payload, scale | None)` pair travels apart.

Reads gather first and dequantize after the gather, so a selected set of entries is never
materialized as a new cache. Writes are masked: an invalid write is dropped, never clipped onto a
valid row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.formats import QuantFormat, as_bits, decode_entries, quantize

Array = jax.Array

NO_ENTRY = -1  # a row or entry id that names nothing: a read of it sees no entry, a write to it is dropped


@functools.partial(jax.tree_util.register_dataclass, data_fields=["payload", "scale"], meta_fields=["fmt"])
@dataclasses.dataclass(frozen=True)
class Stored:
    """Entries `[..., rows, ·]` in format `fmt`.

    payload: [..., rows, D // 2] uint8 (e2m1 pairs) | [..., rows, D] uint8 (e4m3 bits) | [..., rows, D] float32
    scale:   [..., rows, D // fmt.block] uint8 (e4m3 or ue8m0 bits), or None for float storage
    """

    payload: Array
    scale: Array | None
    fmt: QuantFormat

    @classmethod
    def empty(cls, lead: tuple[int, ...], dim: int, fmt: QuantFormat, packed: bool) -> "Stored":
        """Zero entries `[*lead, ·]`. Empty scales are 1: ue8m0 has no zero (0.0 would decode to NaN)."""
        if not packed:
            return cls(jnp.zeros((*lead, dim), jnp.float32), None, fmt)
        one = as_bits(jnp.ones((), fmt.scale_dtype))
        return cls(jnp.zeros((*lead, fmt.payload_width(dim)), jnp.uint8),
                   jnp.full((*lead, dim // fmt.block), one, jnp.uint8), fmt)

    @classmethod
    def quantized(cls, x: Array, fmt: QuantFormat) -> "Stored":
        """Packed entries of float values `x [..., D]` (SPEC §8 encoding), as bytes."""
        payload, scales = quantize(x, fmt)
        return cls(as_bits(payload), as_bits(scales), fmt)

    @property
    def packed(self) -> bool:
        return self.scale is not None

    @property
    def dim(self) -> int:
        """Features per entry (D)."""
        return self.payload.shape[-1] * 8 // self.fmt.payload_bits if self.packed else self.payload.shape[-1]

    @property
    def rows(self) -> int:
        return self.payload.shape[-2]

    def bits(self) -> tuple[Array, Array | None]:
        """What kernels read: (uint8 payload bits, uint8 scale bits) when packed; (float32 values, None) otherwise."""
        return (as_bits(self.payload), as_bits(self.scale)) if self.packed else (self.payload, None)

    def reshape_rows(self, *lead: int) -> "Stored":
        """The same entries with the non-feature axes reshaped to `lead` (e.g. `[B, G, N]` ↔ `[B, G·N]`)."""
        return jax.tree.map(lambda a: a.reshape(*lead, a.shape[-1]), self)

    def decode(self) -> Array:
        """Every entry as float32 `[..., rows, D]`."""
        return decode_entries(*self.bits(), self.fmt)

    def gather(self, idx: Array) -> Array:
        """Rows `idx [B, ...]` of per-row buffers `[B, rows, ·]` as float32 `[B, ..., D]`.

        Ids outside `[0, rows)` (e.g. −1 padding) read row 0: the caller masks them.
        """
        idx = jnp.where((idx >= 0) & (idx < self.rows), idx, 0)
        batch = jnp.arange(idx.shape[0]).reshape(-1, *([1] * (idx.ndim - 1)))
        rows = jax.tree.map(lambda a: a[batch, idx], self)
        return rows.decode()

    def write(self, idx: Array, entries: "Stored", valid: Array) -> "Stored":
        """Per-row buffers `[B, rows, ·]` with `entries [B, S, ·]` written at `idx [B, S]` where `valid [B, S]`.

        `entries` must be in this buffer's format and storage (see `csa2.cache.encode`); invalid
        writes and ids outside `[0, rows)` are dropped (sent out of bounds), never clipped or wrapped
        onto a valid row.
        """
        if entries.fmt != self.fmt or entries.packed != self.packed:
            raise ValueError(f"write: entries in {entries.fmt.name!r} (packed={entries.packed}) into a "
                             f"{self.fmt.name!r} buffer (packed={self.packed}); encode them in the buffer's format")
        idx = jnp.where(valid & (idx >= 0), idx, self.rows)  # a negative index would wrap onto a valid row
        batch = jnp.arange(idx.shape[0])[:, None]
        return jax.tree.map(lambda buf, x: buf.at[batch, idx].set(x.astype(buf.dtype), mode="drop"), self, entries)


def concat_rows(a: Stored, b: Stored) -> Stored:
    """`a` then `b` along the rows axis (same format and storage)."""
    return jax.tree.map(lambda x, y: jnp.concatenate([x, y.astype(x.dtype)], axis=-2), a, b)
