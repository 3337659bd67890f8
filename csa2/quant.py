"""Straight-through fake quantization (SPEC §8): the storage formats' rounding inside a float graph.

`fake_quant(x, fmt)` is `dequantize(quantize(x))` of `pallas_kernels.formats` (where the formats
live, once) bit for bit, in `x.dtype`, so QAT and the float cache see exactly what the packed cache
stores. Its gradient is straight-through: identity where `|x / scale| ≤ payload max`, zero where
the clamp bites (only `MAIN` can clamp).

`NUMERICS` names the two numerics inference runs: `"spec"`, the SPEC §8 default (Main KV, Indexer Q/K and window
KV rounded to their storage formats, in a packed or a float cache), and `"float"`, the float model (nothing
rounded; a float cache), the reference that exactness properties are checked against to float rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.formats import INDEX, MAIN, WINDOW, QuantFormat, dequantize, encode_blocks, scaled_blocks

__all__ = ["fake_quant", "MAIN", "INDEX", "WINDOW", "NUMERICS"]

NUMERICS = ("spec", "float")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fake_quant(x: jax.Array, fmt: QuantFormat) -> jax.Array:
    """dequantize(quantize(x)) in x.dtype, with a straight-through gradient."""
    return _fake_quant_fwd(x, fmt)[0]


def _fake_quant_fwd(x: jax.Array, fmt: QuantFormat) -> tuple[jax.Array, jax.Array]:
    """Fake-quant output plus the in-clamp-range mask used by the backward pass."""
    v, scales = scaled_blocks(x, fmt)
    out = dequantize(encode_blocks(v, fmt), scales, fmt, dtype=x.dtype)
    return out, (jnp.abs(v) <= fmt.payload_max).reshape(x.shape)


def _fake_quant_bwd(fmt: QuantFormat, in_range: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    """Straight-through gradient: pass `g` inside the clamp range, zero outside."""
    del fmt
    return (jnp.where(in_range, g, jnp.zeros_like(g)),)


fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)
