"""The released checkpoint's weight formats: decoded on the host into float32, and encoded back.

These are storage formats of the release's *weights* (not the cache formats of SPEC §8, which live in
`pallas_kernels.formats`). Every scale is UE8M0 (`F8_E8M0`, value `2^(code − 127)`), and the values
come from `ml_dtypes` casts (e4m3, e2m1, e8m0), so nothing here re-derives a bit table.

Each format: the released tensors in it; the payload; the scale (`F8_E8M0`).

- `FP8_BLOCK`: attention `wq_a wq_b wkv wo_a wo_b`, indexer `wq_b`, shared experts, Engram `wkv`, DSpark `main_proj`;
  `F8_E4M3 [out, in]`; `[⌈out/32⌉, ⌈in/32⌉]`, one per 32×32 tile
- `FP4`: routed experts `w1 w2 w3`; `I8 [out, in/2]`, two e2m1 codes per byte: column 2k in the low nibble, 2k+1 in
  the high one; `[out, ⌈in/32⌉]`, one per row and 32 columns
- `FP8_ROWS`: Engram tables `engram.embed`; `F8_E4M3 [rows, dim]`; `[rows, ⌈dim/32⌉]`, one per row and 32 columns

Decoding: `w[r, c] = payload[r, c] · scale[tile of (r, c)]`, in float32; a tile cut short by the
tensor's edge uses its tile's scale (the release's dimensions are all multiples of 32).
Encoding (what `save_hf(..., formats="released")` and the tests' synthetic checkpoints write): per tile,
`scale = 2^⌈log2(amax / payload_max)⌉` (rounded up, so no value clamps; an all-zero tile gets the
smallest scale), then the payload is `w / scale` rounded to nearest-even (448 for e4m3, 6 for e2m1).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

TILE = 32  # the release's `weight_block_size` [32, 32] and its per-row group of 32


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one released tensor is stored: payload dtype code, tile of one scale (rows, columns), payload max."""

    name: str
    payload: str  # safetensors dtype code of `<base>.weight`
    tile_rows: int
    payload_max: float

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """Shape of the `<base>.scale` of a weight of logical shape `[out, in]`."""
        return -(-shape[0] // self.tile_rows), -(-shape[1] // TILE)

    def stored_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """Shape of the `<base>.weight` payload of a weight of logical shape `[out, in]`."""
        return (shape[0], shape[1] // 2) if self is FP4 else tuple(shape)


FP8_BLOCK = WeightFormat("fp8_block", "F8_E4M3", TILE, 448.0)
FP4 = WeightFormat("fp4", "I8", 1, 6.0)
FP8_ROWS = WeightFormat("fp8_rows", "F8_E4M3", 1, 448.0)
FORMATS = (FP8_BLOCK, FP4, FP8_ROWS)


def _check(fmt: WeightFormat, payload: np.ndarray, scale: np.ndarray, name: str) -> tuple[int, int]:
    if payload.ndim != 2:
        raise ValueError(f"tensor {name!r}: payload shape {payload.shape}; {fmt.name} weights are 2-D [out, in]")
    shape = (payload.shape[0], payload.shape[1] * 2) if fmt is FP4 else payload.shape
    if scale.shape != fmt.scale_shape(shape):
        raise ValueError(f"tensor {name!r}: scale shape {scale.shape}; a {fmt.name} weight of logical shape "
                         f"{shape} needs {fmt.scale_shape(shape)}")
    return shape


def _scale_values(scale: np.ndarray, fmt: WeightFormat, shape: tuple[int, int]) -> np.ndarray:
    """float32 scale of every element `[out, in]` from the UE8M0 tiles."""
    values = np.asarray(scale).view(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    full = np.repeat(np.repeat(values, fmt.tile_rows, axis=0), TILE, axis=1)
    return full[:shape[0], :shape[1]]


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """float32 `[out, 2·in_bytes]` e2m1 values of packed bytes (low nibble = even column)."""
    codes = np.asarray(packed).view(np.uint8)
    pairs = np.stack([codes & 15, codes >> 4], axis=-1).reshape(codes.shape[0], -1)
    return pairs.view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def decode(fmt: WeightFormat, payload: np.ndarray, scale: np.ndarray, name: str = "weight") -> np.ndarray:
    """float32 logical weight `[out, in]` from a stored payload and its UE8M0 scale."""
    shape = _check(fmt, payload, scale, name)
    values = unpack_fp4(payload) if fmt is FP4 else np.asarray(payload).astype(np.float32)
    return values * _scale_values(scale, fmt, shape)


def encode(fmt: WeightFormat, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(payload, scale)` in format `fmt` for a float weight `[out, in]` (`in` even for FP4)."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or (fmt is FP4 and w.shape[1] % 2):
        raise ValueError(f"encode: weight shape {w.shape}; {fmt.name} needs 2-D [out, in]"
                         + (" with even in" if fmt is FP4 else ""))
    rows, cols = fmt.scale_shape(w.shape)
    padded = np.zeros((rows * fmt.tile_rows, cols * TILE), np.float32)
    padded[:w.shape[0], :w.shape[1]] = np.abs(w)
    amax = padded.reshape(rows, fmt.tile_rows, cols, TILE).max(axis=(1, 3))
    exponent = np.ceil(np.log2(np.maximum(amax, np.float32(2.0**-126)) / fmt.payload_max))
    codes = (np.clip(exponent, -127, 127) + 127).astype(np.uint8)
    scale = codes.view(ml_dtypes.float8_e8m0fnu)
    scaled = w / _scale_values(scale, fmt, w.shape)
    if fmt is FP4:
        nibbles = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15
        payload = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).view(np.int8)
    else:
        payload = scaled.astype(ml_dtypes.float8_e4m3fn)
    return payload, scale
