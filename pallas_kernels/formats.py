"""The block-scaled storage formats of SPEC §8, written once: encode, and decode from raw bits.

| format   | tensor                   | payload  | scale per block of the last axis                      | bytes/entry |
|----------|--------------------------|----------|-------------------------------------------------------|-------------|
| `MAIN`   | Global Main KV (512)     | FP4 e2m1 | e4m3 per 16: `e4m3(max(amax, 6*2^-9) / 6)`            | 256+32=288  |
| `INDEX`  | Indexer K/Q (128), MXFP4 | FP4 e2m1 | ue8m0 per 32: `2^ceil(log2(max(amax, 6*2^-126) / 6))` | 64+4=68     |
| `WINDOW` | SWA ring KV (512)        | FP8 e4m3 | ue8m0 per 32: `2^ceil(log2(max(amax, 1e-4) / 448))`   | 512+16=528  |

Encoding (`quantize`):
- The last axis is the feature axis and must be divisible by the format's block; any leading
  dims are allowed. All math is float32 whatever the input dtype.
- Payload values are `x / scale`, clamped to the payload range (±6 for e2m1, ±448 for e4m3), then
  rounded to nearest-even. The clamp is explicit: an unclamped cast to e4m3 yields NaN. Only
  `MAIN` can clamp (its e4m3 scale may round below amax/6, and it saturates at 6·448 = 2688 for
  amax > ~2688); ue8m0 scales round up, so `INDEX`/`WINDOW` never clamp.
- FP4 packing: payload is uint8 `[..., D // 2]` with two e2m1 codes per byte; element `2i` is in
  the LOW nibble and element `2i + 1` in the HIGH nibble. An e2m1 code is
  `sign << 3 | exponent << 1 | mantissa` (0..7 → 0, .5, 1, 1.5, 2, 3, 4, 6).
- `WINDOW` payload is `float8_e4m3fn` `[..., D]`; scales are `float8_e4m3fn` `[..., D // 16]` (`MAIN`)
  or `float8_e8m0fnu` `[..., D // 32]` (`INDEX`, `WINDOW`), one byte each.

Decoding (`dequantize`, `decode_bits`) works on the uint8 bit patterns with integer ops, shifts and a
bitcast only, so the same code runs in XLA (the reference), in the Pallas interpreter and in the
Triton lowering (which has no `e8m0` type): kernels and reference are bit-identical. Values are
`payload × scale` in float32, clipped to ±float32 max (possible for `INDEX`/`WINDOW` within one
rounding step of it). Signed zeros are kept; all-zero blocks use the floor scale and decode to
zeros; results that would be float32 subnormals may be flushed to zero by the backend (XLA:CPU does).
Inputs must be finite.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

__all__ = ["QuantFormat", "MAIN", "INDEX", "WINDOW", "entry_bytes", "scaled_blocks", "encode_blocks", "quantize",
           "dequantize", "decode_bits", "decode_entries", "as_bits", "e2m1_to_f32", "e4m3_to_f32", "e8m0_to_f32"]


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """One block-scaled storage format of SPEC §8 (hashable: a static argument and pytree metadata)."""

    name: str
    block: int  # features per scale
    payload_bits: int  # 4 (e2m1, packed in pairs) or 8 (e4m3)
    payload_max: float  # largest payload magnitude: 6 (e2m1) or 448 (e4m3)
    scale_dtype: type  # jnp.float8_e4m3fn or jnp.float8_e8m0fnu
    amax_floor: float  # amax is raised to this before computing the scale

    @property
    def payload_dtype(self):
        """Stored payload dtype: uint8 (two e2m1 codes per byte) or float8_e4m3fn."""
        return jnp.uint8 if self.payload_bits == 4 else jnp.float8_e4m3fn

    def payload_width(self, dim: int) -> int:
        """Payload elements per entry of `dim` features."""
        return dim * self.payload_bits // 8


MAIN = QuantFormat("main", 16, 4, 6.0, jnp.float8_e4m3fn, 6.0 * 2.0**-9)
INDEX = QuantFormat("index", 32, 4, 6.0, jnp.float8_e8m0fnu, 6.0 * 2.0**-126)
WINDOW = QuantFormat("window", 32, 8, 448.0, jnp.float8_e8m0fnu, 1e-4)

_E4M3_MAX = 448.0
_F32_MAX = float(np.finfo(np.float32).max)
_F32_NAN_BITS = 0x7FC00000
_E8M0_ZERO_BITS = 0x00400000  # 2^-127, a float32 subnormal


def _check_dim(fmt: QuantFormat, dim: int, what: str) -> None:
    """Raise ValueError unless `dim` is a positive multiple of the format block."""
    if dim <= 0 or dim % fmt.block:
        raise ValueError(f"{what}={dim} is not a positive multiple of the {fmt.name!r} block size {fmt.block}; "
                         f"pad the feature (last) axis to a multiple of {fmt.block}.")


def entry_bytes(fmt: QuantFormat, dim: int) -> int:
    """Payload plus scale bytes for one entry of `dim` features."""
    _check_dim(fmt, dim, "dim")
    return fmt.payload_width(dim) + dim // fmt.block * jnp.dtype(fmt.scale_dtype).itemsize


# ---------------------------------------------------------------------------------------------
# Encoding

def _e4m3_scale(t: Array) -> Array:
    """e4m3 scale: round-to-nearest-even of `t`, clamped to 448 first."""
    return jnp.minimum(t, _E4M3_MAX).astype(jnp.float8_e4m3fn)


def _ue8m0_scale(t: Array) -> Array:
    """ue8m0 scale 2^ceil(log2(t)) computed exactly from the bits of a positive normal `t`."""
    bits = lax.bitcast_convert_type(t, jnp.uint32)
    biased_exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
    return lax.bitcast_convert_type(biased_exp.astype(jnp.uint8), jnp.float8_e8m0fnu)


def scaled_blocks(x: Array, fmt: QuantFormat) -> tuple[Array, Array]:
    """float32 `x / scale` as blocks `[..., D // block, block]` (before the clamp) and the scales
    `[..., D // block]`."""
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("x must have a feature axis, got a scalar; pass x with shape [..., D].")
    _check_dim(fmt, x.shape[-1], "x.shape[-1]")
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // fmt.block, fmt.block)
    t = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), fmt.amax_floor) / fmt.payload_max
    scales = _e4m3_scale(t) if fmt.scale_dtype == jnp.float8_e4m3fn else _ue8m0_scale(t)
    return xb / scales.astype(jnp.float32)[..., None], scales


def encode_blocks(v: Array, fmt: QuantFormat) -> Array:
    """Payload of scaled blocks `v [..., D // block, block]`: clamp, round to nearest-even, pack/store."""
    v = jnp.clip(v, -fmt.payload_max, fmt.payload_max).reshape(*v.shape[:-2], -1)
    if fmt.payload_bits == 8:
        return v.astype(jnp.float8_e4m3fn)
    codes = lax.bitcast_convert_type(v.astype(jnp.float4_e2m1fn), jnp.uint4).astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize(x: Array, fmt: QuantFormat) -> tuple[Array, Array]:
    """`x [..., D]` → (payload, scales) in format `fmt`."""
    v, scales = scaled_blocks(x, fmt)
    return encode_blocks(v, fmt), scales


# ---------------------------------------------------------------------------------------------
# Decoding from bits (shared by the reference and the kernels)

def as_bits(x: Array | None) -> Array | None:
    """uint8 bit pattern of a one-byte array (float8 scales or payload); uint8 passes through."""
    if x is None or x.dtype == jnp.uint8:
        return x
    if jnp.dtype(x.dtype).itemsize != 1:
        raise ValueError(f"as_bits: dtype {x.dtype} is not a one-byte type; pass float8 or uint8 bits")
    return lax.bitcast_convert_type(x, jnp.uint8)


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


def _payload_values(payload_bits: Array, fmt: QuantFormat) -> Array:
    """float32 payload values [..., D] from stored payload bits (uint8)."""
    codes = payload_bits.astype(jnp.int32)
    if fmt.payload_bits == 8:
        return e4m3_to_f32(codes)
    pairs = jnp.stack([e2m1_to_f32(codes & 15), e2m1_to_f32(codes >> 4)], axis=-1)  # low nibble first
    return pairs.reshape(*payload_bits.shape[:-1], 2 * payload_bits.shape[-1])


def _scale_values(scale_bits: Array, fmt: QuantFormat) -> Array:
    codes = scale_bits.astype(jnp.int32)
    return e4m3_to_f32(codes) if fmt.scale_dtype == jnp.float8_e4m3fn else e8m0_to_f32(codes)


def decode_bits(payload_bits: Array, scale_bits: Array, fmt: QuantFormat) -> Array:
    """float32 entries [..., D] from uint8 payload bits and uint8 scale bits (usable inside kernels)."""
    values = _payload_values(payload_bits, fmt)
    lead, d = values.shape[:-1], values.shape[-1]
    out = values.reshape(*lead, d // fmt.block, fmt.block) * _scale_values(scale_bits, fmt)[..., None]
    return jnp.clip(out, -_F32_MAX, _F32_MAX).reshape(*lead, d)


def decode_entries(payload: Array, scale_bits: Array | None, fmt: QuantFormat) -> Array:
    """float32 entries from stored rows: decode the bits when packed (`scale_bits` given), else cast."""
    return payload.astype(jnp.float32) if scale_bits is None else decode_bits(payload, scale_bits, fmt)


def dequantize(payload: Array, scales: Array, fmt: QuantFormat, dtype=jnp.float32) -> Array:
    """`x [..., D]` in `dtype` from (payload, scales) in format `fmt` (the pair `quantize` returns)."""
    payload, scales = jnp.asarray(payload), jnp.asarray(scales)
    dim = payload.shape[-1] * 8 // fmt.payload_bits if payload.ndim else 0
    if payload.ndim == 0 or payload.shape[:-1] != scales.shape[:-1] or scales.shape[-1] * fmt.block != dim:
        raise ValueError(f"payload.shape={payload.shape} and scales.shape={scales.shape} do not match format "
                         f"{fmt.name!r}; pass the pair returned by quantize (scales.shape[-1] == D // {fmt.block}).")
    return decode_bits(as_bits(payload), as_bits(scales), fmt).astype(dtype)
