"""Block-scaled storage formats of the model (SPEC §8): quantize, dequantize, fake-quant.

| format   | tensor                   | payload  | scale per block of the last axis                      | bytes/entry |
|----------|--------------------------|----------|-------------------------------------------------------|-------------|
| `main`   | Global Main KV (512)     | FP4 e2m1 | e4m3 per 16: `e4m3(max(amax, 6*2^-9) / 6)`            | 256+32=288  |
| `index`  | Indexer K/Q (128), MXFP4 | FP4 e2m1 | ue8m0 per 32: `2^ceil(log2(max(amax, 6*2^-126) / 6))` | 64+4=68     |
| `window` | SWA ring KV (512)        | FP8 e4m3 | ue8m0 per 32: `2^ceil(log2(max(amax, 1e-4) / 448))`   | 512+16=528  |

Conventions:
- The last axis is the feature axis and must be divisible by the format's block; any leading
  batch dims are allowed. All math is done in float32 whatever the input dtype.
- Payload values are `x / scale`, clamped to the payload range (±6 for e2m1, ±448 for e4m3) and
  then rounded to nearest-even. The clamp is explicit: an unclamped cast to e4m3 yields NaN.
  Only `main` can clamp (its e4m3 scale may round below amax/6, and it saturates at
  6 * 448 = 2688 for amax > ~2688); ue8m0 scales round up, so `index`/`window` never clamp.
- FP4 packing: payload is uint8 `[..., D // 2]` with two e2m1 codes per byte; element `2i` is
  in the LOW nibble and element `2i + 1` in the HIGH nibble (`byte = code[2i] | code[2i+1] << 4`).
  An e2m1 code is `sign << 3 | exponent << 1 | mantissa` (0..7 -> 0, .5, 1, 1.5, 2, 3, 4, 6).
- Window payload is `float8_e4m3fn` `[..., D]`. Scales are `float8_e4m3fn` `[..., D // 16]`
  (main) or `float8_e8m0fnu` `[..., D // 32]` (index, window), one byte each.
- Signed zeros are kept: -0.0 and negatives that round to zero dequantize to -0.0.
  All-zero blocks use the floor scale and dequantize to zeros. At the floor scale the smallest
  nonzero outputs are main 2^-10, index 2^-127, window 2^-31; magnitudes up to half of that
  round to zero, and results that would be float32 subnormals may be flushed to zero by the
  backend (XLA:CPU does).
  Dequantized magnitudes above float32 max (possible for index/window when |x| is within one
  rounding step of it, e.g. 3e38 -> 4 * 2^126) saturate to float32 max. Inputs must be finite.
- `fake_quant(x) == dequantize(*quantize(x))` bit for bit, in `x.dtype`. Its gradient is
  straight-through: identity where `|x / scale| <= payload max`, zero where the clamp bites.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

__all__ = [
    "QuantFormat", "MAIN", "INDEX", "WINDOW", "entry_bytes",
    "quantize", "dequantize", "fake_quant",
    "quantize_main", "dequantize_main", "fake_quant_main",
    "quantize_index", "dequantize_index", "fake_quant_index",
    "quantize_window", "dequantize_window", "fake_quant_window",
]


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """One block-scaled storage format of SPEC §8."""

    name: str
    block: int  # features per scale
    payload_bits: int  # 4 (e2m1, packed in pairs) or 8 (e4m3)
    payload_max: float  # largest payload magnitude: 6 (e2m1) or 448 (e4m3)
    scale_dtype: type  # jnp.float8_e4m3fn or jnp.float8_e8m0fnu
    amax_floor: float  # amax is raised to this before computing the scale


MAIN = QuantFormat("main", 16, 4, 6.0, jnp.float8_e4m3fn, 6.0 * 2.0**-9)
INDEX = QuantFormat("index", 32, 4, 6.0, jnp.float8_e8m0fnu, 6.0 * 2.0**-126)
WINDOW = QuantFormat("window", 32, 8, 448.0, jnp.float8_e8m0fnu, 1e-4)

_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
_F32_MAX = float(np.finfo(np.float32).max)
# float32 value of every e2m1 code 0..15 (code 8 is -0.0).
_E2M1_VALUES = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def entry_bytes(fmt: QuantFormat, dim: int) -> int:
    """Payload plus scale bytes for one entry of `dim` features."""
    _check_dim(fmt, dim, "dim")
    return dim * fmt.payload_bits // 8 + dim // fmt.block * jnp.dtype(fmt.scale_dtype).itemsize


def _check_dim(fmt: QuantFormat, dim: int, what: str) -> None:
    """Raise ValueError unless `dim` is a positive multiple of the format block."""
    if dim <= 0 or dim % fmt.block:
        raise ValueError(
            f"{what}={dim} is not a positive multiple of the {fmt.name!r} block size {fmt.block}; "
            f"pad the feature (last) axis to a multiple of {fmt.block}."
        )


def _e4m3_scale(t: jax.Array) -> jax.Array:
    """e4m3 scale: round-to-nearest-even of `t`, clamped to 448 first."""
    return jnp.minimum(t, _E4M3_MAX).astype(jnp.float8_e4m3fn)


def _ue8m0_scale(t: jax.Array) -> jax.Array:
    """ue8m0 scale 2^ceil(log2(t)) computed exactly from the bits of a positive normal `t`."""
    bits = lax.bitcast_convert_type(t, jnp.uint32)
    biased_exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
    return lax.bitcast_convert_type(biased_exp.astype(jnp.uint8), jnp.float8_e8m0fnu)


def _scaled(x: jax.Array, fmt: QuantFormat) -> tuple[jax.Array, jax.Array]:
    """Return float32 `x / scale` as blocks [..., D // block, block] (unclamped) and the scales."""
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("x must have a feature axis, got a scalar; pass x with shape [..., D].")
    _check_dim(fmt, x.shape[-1], "x.shape[-1]")
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // fmt.block, fmt.block)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    t = jnp.maximum(amax, fmt.amax_floor) / fmt.payload_max
    scales = _e4m3_scale(t) if fmt.scale_dtype == jnp.float8_e4m3fn else _ue8m0_scale(t)
    return xb / scales.astype(jnp.float32)[..., None], scales


def _encode(v: jax.Array, fmt: QuantFormat) -> jax.Array:
    """Clamp scaled blocks to the payload range, round to nearest-even and pack/store."""
    v = jnp.clip(v, -fmt.payload_max, fmt.payload_max)
    v = v.reshape(*v.shape[:-2], -1)
    if fmt.payload_bits == 8:
        return v.astype(jnp.float8_e4m3fn)
    codes = lax.bitcast_convert_type(v.astype(jnp.float4_e2m1fn), jnp.uint4).astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _decode(payload: jax.Array, fmt: QuantFormat) -> jax.Array:
    """Float32 payload values [..., D] from stored payload."""
    if fmt.payload_bits == 8:
        return payload.astype(jnp.float32)
    codes = jnp.stack([payload & 0xF, payload >> 4], axis=-1).reshape(*payload.shape[:-1], -1)
    return jnp.asarray(_E2M1_VALUES)[codes]


def quantize(x: jax.Array, fmt: QuantFormat) -> tuple[jax.Array, jax.Array]:
    """Quantize `x` [..., D] to (payload, scales) in format `fmt`."""
    v, scales = _scaled(x, fmt)
    return _encode(v, fmt), scales


def dequantize(
    payload: jax.Array, scales: jax.Array, fmt: QuantFormat, dtype=jnp.float32
) -> jax.Array:
    """Reconstruct x [..., D] in `dtype` from (payload, scales) in format `fmt`."""
    payload, scales = jnp.asarray(payload), jnp.asarray(scales)
    dim = payload.shape[-1] * 8 // fmt.payload_bits if payload.ndim else 0
    if payload.ndim == 0 or payload.shape[:-1] != scales.shape[:-1] or (
        scales.shape[-1] * fmt.block != dim
    ):
        raise ValueError(
            f"payload.shape={payload.shape} and scales.shape={scales.shape} do not match format "
            f"{fmt.name!r}; pass the pair returned by quantize (scales.shape[-1] == D // {fmt.block})."
        )
    vals = _decode(payload, fmt).reshape(*scales.shape, fmt.block)
    out = jnp.clip(vals * scales.astype(jnp.float32)[..., None], -_F32_MAX, _F32_MAX)
    return out.reshape(*payload.shape[:-1], dim).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fake_quant(x: jax.Array, fmt: QuantFormat) -> jax.Array:
    """dequantize(quantize(x)) in x.dtype, with a straight-through gradient."""
    return _fake_quant_fwd(x, fmt)[0]


def _fake_quant_fwd(x: jax.Array, fmt: QuantFormat) -> tuple[jax.Array, jax.Array]:
    """Fake-quant output plus the in-clamp-range mask used by the backward pass."""
    v, scales = _scaled(x, fmt)
    out = dequantize(_encode(v, fmt), scales, fmt, dtype=x.dtype)
    return out, (jnp.abs(v) <= fmt.payload_max).reshape(x.shape)


def _fake_quant_bwd(fmt: QuantFormat, in_range: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    """Straight-through gradient: pass `g` inside the clamp range, zero outside."""
    del fmt
    return (jnp.where(in_range, g, jnp.zeros_like(g)),)


fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def quantize_main(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Global Main KV: packed e2m1 payload [..., D//2] uint8, e4m3 scales [..., D//16]."""
    return quantize(x, MAIN)


def dequantize_main(payload: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Inverse of quantize_main."""
    return dequantize(payload, scales, MAIN, dtype)


def fake_quant_main(x: jax.Array) -> jax.Array:
    """Main-format fake quantization with straight-through gradient."""
    return fake_quant(x, MAIN)


def quantize_index(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Indexer K/Q (MXFP4): packed e2m1 payload [..., D//2] uint8, ue8m0 scales [..., D//32]."""
    return quantize(x, INDEX)


def dequantize_index(payload: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Inverse of quantize_index."""
    return dequantize(payload, scales, INDEX, dtype)


def fake_quant_index(x: jax.Array) -> jax.Array:
    """Index-format fake quantization with straight-through gradient."""
    return fake_quant(x, INDEX)


def quantize_window(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """SWA ring KV: e4m3 payload [..., D], ue8m0 scales [..., D//32]."""
    return quantize(x, WINDOW)


def dequantize_window(payload: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Inverse of quantize_window."""
    return dequantize(payload, scales, WINDOW, dtype)


def fake_quant_window(x: jax.Array) -> jax.Array:
    """Window-format fake quantization with straight-through gradient."""
    return fake_quant(x, WINDOW)
