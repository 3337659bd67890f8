"""csa2.checkpoints.weights: the release's FP8 32×32 blocks, packed FP4 experts and FP8 Engram rows, against
values computed by hand, and encode → decode."""

import ml_dtypes
import numpy as np
import pytest

from csa2.checkpoints import weights
from csa2.checkpoints.weights import FP4, FP8_BLOCK, FP8_ROWS, decode, encode


def e8m0(*exponents):
    """UE8M0 scale bytes of 2^e for each exponent."""
    return np.asarray([e + 127 for e in exponents], np.uint8).view(ml_dtypes.float8_e8m0fnu)


def test_fp8_block_scales_each_32x32_tile_and_the_cut_tiles_at_the_edge():
    # A 33×35 weight has a 2×2 grid of scales; element (r, c) uses scale (r // 32, c // 32).
    payload = np.full((33, 35), 1.5, ml_dtypes.float8_e4m3fn)
    payload[0, 0], payload[32, 34] = -448.0, 0.015625  # e4m3 max and 2^-6
    scale = e8m0(0, 1, -2, 3).reshape(2, 2)
    w = decode(FP8_BLOCK, payload, scale)
    assert w.dtype == np.float32 and w.shape == (33, 35)
    assert w[0, 0] == -448.0 and w[31, 31] == 1.5
    assert w[0, 32] == 3.0 and w[31, 34] == 3.0  # tile (0, 1): 1.5 · 2
    assert w[32, 0] == 0.375 and w[32, 31] == 0.375  # tile (1, 0): 1.5 · 2^-2
    assert w[32, 34] == 0.015625 * 8  # tile (1, 1): 2^-6 · 2^3


def test_fp4_nibble_order_sign_and_row_scales():
    # Byte 0xA1: low nibble 0x1 (= +0.5) is column 0, high nibble 0xA (= −1.0) is column 1.
    # Byte 0x7F: low 0xF (= −6), high 0x7 (= +6). One scale per row and 32 columns.
    packed = np.zeros((2, 32), np.uint8)
    packed[0, 0], packed[0, 1], packed[1, 16] = 0xA1, 0x7F, 0x25
    scale = e8m0(-1, 4, 2, 0).reshape(2, 2)
    w = decode(FP4, packed.view(np.int8), scale)
    assert w.shape == (2, 64)
    np.testing.assert_array_equal(w[0, :4], [0.25, -0.5, -3.0, 3.0])  # ·2^-1
    assert w[0, 32:].tolist() == [0.0] * 32
    # Row 1, byte 16 = columns 32, 33 in the second scale block (2^0): 0x5 = 3.0, 0x2 = 1.0.
    assert (w[1, 32], w[1, 33]) == (3.0, 1.0)


def test_fp8_rows_scale_every_row_and_32_columns_on_its_own():
    payload = np.ones((3, 16), ml_dtypes.float8_e4m3fn)  # Engram rows narrower than 32: one scale per row
    w = decode(FP8_ROWS, payload, e8m0(0, 5, -3).reshape(3, 1))
    np.testing.assert_array_equal(w[:, 0], [1.0, 32.0, 0.125])


@pytest.mark.parametrize("fmt", weights.FORMATS, ids=lambda f: f.name)
def test_encode_then_decode_is_exact_on_the_grid_and_close_elsewhere(fmt):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 70)).astype(np.float32) * np.float32(0.03)
    payload, scale = encode(fmt, w)
    assert payload.shape == fmt.stored_shape(w.shape) and scale.shape == fmt.scale_shape(w.shape)
    assert scale.dtype == ml_dtypes.float8_e8m0fnu
    back = decode(fmt, payload, scale)
    # Round to nearest on a grid with ≥ 1 (e2m1) or 3 (e4m3) mantissa bits, scale rounded up: relative error
    # per element ≤ 2^-2 (e2m1) / 2^-4 (e4m3) of the tile's amax.
    bound = 0.25 if fmt is FP4 else 1 / 16
    tiles = np.abs(w).max() if fmt is FP8_BLOCK else np.abs(w).max(axis=1, keepdims=True)
    assert np.all(np.abs(back - w) <= bound * tiles * 2)
    np.testing.assert_array_equal(decode(fmt, *encode(fmt, back)), back)  # decoded values are on the grid


def test_decode_refuses_a_scale_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"'layers.0.attn.wkv.weight'.*scale shape \(1, 1\).*needs \(2, 2\)"):
        decode(FP8_BLOCK, np.ones((33, 35), ml_dtypes.float8_e4m3fn), e8m0(0).reshape(1, 1), "layers.0.attn.wkv.weight")
