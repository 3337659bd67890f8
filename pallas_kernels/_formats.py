"""Dequantization of the SPEC §8 storage formats from raw bits, shared by oracles and kernels.

Every decoder works on uint8/int32 bit patterns with integer ops, shifts and a bitcast only, so
the same code runs in XLA (the reference), in the Pallas CPU interpreter and in the Triton
lowering (which has no float8 `e8m0` type), and the oracle and the kernels are bit-identical.

- FP4 e2m1 payload: uint8 `[..., D // 2]`, element 2i in the LOW nibble, 2i+1 in the HIGH one;
  code = sign << 3 | exponent << 1 | mantissa.
- e4m3fn (main scales, window payload) and ue8m0 (index / window scales) arrive as their uint8
  bits (`as_bits` below, a free bitcast done outside the kernels).
- value = payload × scale in float32, clipped to ±float32 max (as `csa2.quant.dequantize`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

MAIN_BLOCK = 16  # features per e4m3 scale (Main KV)
INDEX_BLOCK = 32  # features per ue8m0 scale (Indexer K, MXFP4)
WINDOW_BLOCK = 32  # features per ue8m0 scale (SWA ring, FP8 payload)

_F32_MAX = float(np.finfo(np.float32).max)
_F32_NAN_BITS = 0x7FC00000
_E8M0_ZERO_BITS = 0x00400000  # 2^-127, a float32 subnormal


def as_bits(x: Array | None) -> Array | None:
    """uint8 bit pattern of a one-byte array (float8 scales or payload); uint8 passes through."""
    if x is None or x.dtype == jnp.uint8:
        return x
    if jnp.dtype(x.dtype).itemsize != 1:
        raise ValueError(f"as_bits: dtype {x.dtype} is not a one-byte type; pass float8 or uint8 bits")
    return lax.bitcast_convert_type(x, jnp.uint8)


def stored(data: Array, scale: Array | None) -> tuple[Array, Array | None]:
    """A stored buffer as the kernels read it: packed → (uint8 payload bits, uint8 scale bits); float → as is."""
    return (data, None) if scale is None else (as_bits(data), as_bits(scale))


def _f32(bits: Array) -> Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


def e2m1_to_f32(codes: Array) -> Array:
    """float32 value of 4-bit e2m1 codes (int32 0..15): {0, .5, 1, 1.5, 2, 3, 4, 6}, signed (8 → −0.0)."""
    sign = (codes >> 3) << 31
    exp = (codes >> 1) & 3
    man = codes & 1
    normal = ((exp + 126) << 23) | (man << 22)
    magnitude = jnp.where(exp == 0, man * 0x3F000000, normal)  # exp 0: 0 or 0.5 (subnormal e2m1)
    return _f32(magnitude | sign)


def e4m3_to_f32(bits: Array) -> Array:
    """float32 value of float8_e4m3fn bit patterns (int32 0..255), NaN at 0x7F/0xFF."""
    sign = (bits >> 7) << 31
    exp = (bits >> 3) & 15
    man = bits & 7
    normal = ((exp + 120) << 23) | (man << 20)
    subnormal = lax.bitcast_convert_type(man.astype(jnp.float32) * 2.0**-9, jnp.int32)  # exact
    magnitude = jnp.where(exp == 0, subnormal, normal)
    magnitude = jnp.where((bits & 0x7F) == 0x7F, _F32_NAN_BITS, magnitude)
    return _f32(magnitude | sign)


def e8m0_to_f32(bits: Array) -> Array:
    """float32 value 2^(bits − 127) of ue8m0 bit patterns (int32 0..255), NaN at 255."""
    value = jnp.where(bits == 0, _E8M0_ZERO_BITS, bits << 23)
    return _f32(jnp.where(bits == 255, _F32_NAN_BITS, value))


def _scaled(values: Array, scales: Array, block: int) -> Array:
    """values [..., D] × per-block scales [..., D // block], clipped to ±float32 max."""
    lead, d = values.shape[:-1], values.shape[-1]
    out = values.reshape(*lead, d // block, block) * scales[..., None]
    return jnp.clip(out, -_F32_MAX, _F32_MAX).reshape(*lead, d)


def unpack_e2m1(payload: Array) -> Array:
    """float32 values [..., D] of packed e2m1 payload uint8 [..., D // 2] (low nibble first)."""
    codes = payload.astype(jnp.int32)
    pairs = jnp.stack([e2m1_to_f32(codes & 15), e2m1_to_f32(codes >> 4)], axis=-1)  # [..., D/2, 2]
    return pairs.reshape(*payload.shape[:-1], 2 * payload.shape[-1])


def dequant_main(payload: Array, scale_bits: Array) -> Array:
    """Main KV: e2m1 uint8 [..., D/2] + e4m3 bits uint8 [..., D/16] → float32 [..., D]."""
    return _scaled(unpack_e2m1(payload), e4m3_to_f32(scale_bits.astype(jnp.int32)), MAIN_BLOCK)


def dequant_index(payload: Array, scale_bits: Array) -> Array:
    """Indexer K (MXFP4): e2m1 uint8 [..., D/2] + ue8m0 bits uint8 [..., D/32] → float32 [..., D]."""
    return _scaled(unpack_e2m1(payload), e8m0_to_f32(scale_bits.astype(jnp.int32)), INDEX_BLOCK)


def dequant_window(payload_bits: Array, scale_bits: Array) -> Array:
    """SWA ring: e4m3 bits uint8 [..., D] + ue8m0 bits uint8 [..., D/32] → float32 [..., D]."""
    values = e4m3_to_f32(payload_bits.astype(jnp.int32))
    return _scaled(values, e8m0_to_f32(scale_bits.astype(jnp.int32)), WINDOW_BLOCK)


def load_entries(payload: Array, scale_bits: Array | None, kind: str) -> Array:
    """float32 entries from stored rows: dequantize when packed (`scale_bits` given), else cast."""
    if scale_bits is None:
        return payload.astype(jnp.float32)
    return {"main": dequant_main, "index": dequant_index, "window": dequant_window}[kind](payload, scale_bits)
