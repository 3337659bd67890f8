"""pallas_kernels.formats: the SPEC §8 storage formats (main / index / window) at the bit level.

quantize / dequantize / encode_blocks / scales / nibble order / entry_bytes / bad dims, and the bit-level
decoders (`e2m1_to_f32`, `e4m3_to_f32`, `e8m0_to_f32`, `decode_bits`, `decode_entries`) checked
exhaustively against XLA converts and ml_dtypes casts.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import formats
from pallas_kernels.formats import INDEX, MAIN, WINDOW
from pallas_kernels.stored import Stored
from tests.pallas_kernels.cases import np_dequantize, random_blocks, ref_scales, rows_with_amax

FORMATS = [MAIN, INDEX, WINDOW]
FP4_FORMATS = [MAIN, INDEX]
IDS = lambda f: f.name  # noqa: E731
# Jitted once per format (eager dispatch compiles every primitive separately).
Q = jax.jit(formats.quantize, static_argnums=1)
DQ = jax.jit(formats.dequantize, static_argnums=2, static_argnames="dtype")
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _bits(x):
    return np.asarray(x).view(np.uint32)


def _roundtrip(fmt, x):
    """dequantize(quantize(x)) through the public functions, as numpy float32."""
    return np.asarray(DQ(*Q(jnp.asarray(x, jnp.float32), fmt), fmt))


def _ref_fake_quant(fmt, x):
    """Independent float64 reference of dequantize(quantize(x))."""
    s = ref_scales(fmt, x)[..., None]
    xb = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, fmt.block)
    lim = 6.0 if fmt.payload_bits == 4 else 448.0
    cast = ml_dtypes.float4_e2m1fn if fmt.payload_bits == 4 else ml_dtypes.float8_e4m3fn
    v = np.clip(xb / s, -lim, lim).astype(cast).astype(np.float64)
    return (v * s).reshape(x.shape)


# ------------------------------------------------------------------------------- bit-level decoders


@pytest.mark.parametrize("dtype,decode,ml_type", [(jnp.float8_e4m3fn, formats.e4m3_to_f32, ml_dtypes.float8_e4m3fn),
                                                  (jnp.float8_e8m0fnu, formats.e8m0_to_f32, ml_dtypes.float8_e8m0fnu)])
def test_scale_decoders_exhaustive(dtype, decode, ml_type):
    """Every byte decodes exactly as XLA's float8 → float32 convert and as ml_dtypes' cast (NaNs as NaN)."""
    b = jnp.arange(256, dtype=jnp.uint8)
    got = np.asarray(decode(b.astype(jnp.int32)))
    for want in (np.asarray(jax.lax.bitcast_convert_type(b, dtype).astype(jnp.float32)),
                 np.arange(256, dtype=np.uint8).view(ml_type).astype(np.float32)):
        assert np.array_equal(np.isnan(want), np.isnan(got))
        ok = ~np.isnan(want)
        assert np.array_equal(_bits(want)[ok], _bits(got)[ok])


def test_e2m1_decoder_exhaustive():
    codes = jnp.arange(16, dtype=jnp.uint8)
    got = _bits(formats.e2m1_to_f32(codes.astype(jnp.int32)))
    want = np.asarray(jax.lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn).astype(jnp.float32))
    assert np.array_equal(_bits(want), got)
    assert np.array_equal(_bits(np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)), got)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_dequantize_and_decoders_match_ml_dtypes_bit_for_bit(fmt):
    """dequantize, decode_bits / decode_entries of the stored bits and Stored.decode all equal the
    ml_dtypes decoding of the same (payload, scales), bit for bit."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 128)) * np.exp(rng.uniform(-14, 9, (3, 5, 1)))
    x[0, 0] = 0.0
    x[0, 1, :16] = -1e-9  # rounds to −0.0
    x[1, 0] = 3000.0  # main saturates
    payload, scales = Q(jnp.asarray(x, jnp.float32), fmt)
    want = np_dequantize(payload, scales, fmt.name).astype(np.float32)
    assert np.signbit(want[0, 1, :16]).all() and (want[0, 1, :16] == 0).all()
    got = DQ(payload, scales, fmt)
    assert np.array_equal(_bits(want), _bits(got))
    st = Stored(payload, scales, fmt)
    for dec in (jax.jit(formats.decode_entries, static_argnums=2)(*st.bits(), fmt),
                jax.jit(formats.decode_bits, static_argnums=2)(*st.bits(), fmt), st.decode()):
        assert np.array_equal(_bits(want), _bits(dec))


def test_as_bits():
    x = jnp.asarray([1.0, -2.0, 448.0], jnp.float8_e4m3fn)
    bits = formats.as_bits(x)
    assert bits.dtype == jnp.uint8
    np.testing.assert_array_equal(bits, np.asarray(x).view(np.uint8))
    u = jnp.arange(4, dtype=jnp.uint8)
    assert formats.as_bits(u) is u and formats.as_bits(None) is None
    with pytest.raises(ValueError, match="one-byte"):
        formats.as_bits(jnp.ones(3, jnp.float32))


def test_decode_entries_float_storage_is_a_cast():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 32)), jnp.bfloat16)
    out = formats.decode_entries(x, None, MAIN)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, np.asarray(x, np.float32))


# ------------------------------------------------------------------------------- e2m1 rounding


@pytest.mark.parametrize("fmt", FP4_FORMATS, ids=IDS)
def test_e2m1_grid_points_roundtrip_exactly(fmt):
    row = np.zeros(fmt.block, np.float32)
    row[:16] = E2M1_GRID + [-g for g in E2M1_GRID]  # amax 6 -> scale 1
    np.testing.assert_array_equal(_roundtrip(fmt, row), row)


# (input, expected): ties go to the even code, and values one float32 ulp either side go to the
# nearer neighbour.
_TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]
_NEIGHBOURS = {0.25: (0.0, 0.5), 0.75: (0.5, 1.0), 1.25: (1.0, 1.5), 1.75: (1.5, 2.0),
               2.5: (2.0, 3.0), 3.5: (3.0, 4.0), 5.0: (4.0, 6.0)}


def _tie_cases():
    cases = []
    for t, even in _TIES:
        below, above = _NEIGHBOURS[t]
        cases += [(t, even), (np.nextafter(np.float32(t), np.float32(0)), below),
                  (np.nextafter(np.float32(t), np.float32(7)), above)]
    return cases + [(-v, -e) for v, e in cases]


@pytest.mark.parametrize("fmt", FP4_FORMATS, ids=IDS)
def test_e2m1_ties_round_to_even_and_neighbours_to_nearest(fmt):
    values, expected = map(np.float32, zip(*_tie_cases()))
    out = _roundtrip(fmt, rows_with_amax(fmt, values, 6.0))
    np.testing.assert_array_equal(out[:, 1], expected)
    np.testing.assert_array_equal(out[:, 0], 6.0)


@pytest.mark.parametrize("fmt", FP4_FORMATS, ids=IDS)
def test_fp4_nibble_order_low_nibble_is_even_element(fmt):
    x = np.zeros(fmt.block, np.float32)
    x[:8] = [0.5, 1.0, -6.0, 6.0, 0.0, -0.5, 3.0, 4.0]  # codes 1,2 | 15,7 | 0,9 | 5,6
    payload, _ = Q(jnp.asarray(x), fmt)
    assert payload.dtype == jnp.uint8 and payload.shape == (fmt.block // 2,)
    expected = np.zeros(fmt.block // 2, np.uint8)
    expected[:4] = [0x21, 0x7F, 0x90, 0x65]
    np.testing.assert_array_equal(np.asarray(payload), expected)
    # and a hand-built payload decodes the same way
    ones = jnp.ones((1,), fmt.scale_dtype)
    dec = DQ(jnp.asarray(expected), ones, fmt)
    np.testing.assert_array_equal(np.asarray(dec), x)


# ------------------------------------------------------------------------------------- clamping


def test_main_clamps_when_e4m3_scale_rounds_down():
    # amax 6.36: 6.36 / 6 = 1.06 rounds to the e4m3 scale 1.0, so 6.36 / scale > 6 -> clamp.
    out = _roundtrip(MAIN, rows_with_amax(MAIN, [1.0, -2.0], 6.36))
    np.testing.assert_array_equal(out[:, 0], 6.0)
    np.testing.assert_array_equal(out[:, 1], [1.0, -2.0])
    neg = _roundtrip(MAIN, -rows_with_amax(MAIN, [1.0], 6.36))
    assert neg[0, 0] == -6.0


def test_scaled_blocks_are_unclamped():
    """scaled_blocks returns x / scale before the clamp (main: 6.36 / 1.0 > 6); encode_blocks clamps."""
    x = jnp.asarray(rows_with_amax(MAIN, [1.0], 6.36))
    v, scales = formats.scaled_blocks(x, MAIN)
    assert v.shape == (1, 1, MAIN.block) and scales.shape == (1, 1) and scales.dtype == MAIN.scale_dtype
    np.testing.assert_array_equal(np.asarray(scales, np.float32), 1.0)
    np.testing.assert_array_equal(np.asarray(v)[0, 0, :2], np.float32([6.36, 1.0]))
    np.testing.assert_array_equal(formats.encode_blocks(v, MAIN), Q(x, MAIN)[0])


def test_main_saturates_scale_and_payload_for_huge_amax():
    x = rows_with_amax(MAIN, [1e29, -1e30], 1e30)
    _, scales = Q(jnp.asarray(x), MAIN)
    assert np.all(np.asarray(scales.astype(jnp.float32)) == 448.0)
    np.testing.assert_array_equal(_roundtrip(MAIN, x)[:, :2], [[2688.0, 2688.0], [2688.0, -2688.0]])


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_payload_encoder_clamps_out_of_range_values(fmt):
    # ue8m0 scales round up, so index/window never produce |x/scale| > max through quantize; the
    # explicit clamp is tested on the encoder directly (an unclamped e4m3 cast gives NaN).
    lim = fmt.payload_max
    v = np.zeros((1, fmt.block), np.float32)
    v[0, :4] = [lim * 1.2, -lim * 1.2, 1e30, -3e38]
    payload = formats.encode_blocks(jnp.asarray(v)[None], fmt)
    out = np.asarray(formats.dequantize(payload, jnp.ones((1, 1), fmt.scale_dtype), fmt))
    np.testing.assert_array_equal(out[0, :4], [lim, -lim, lim, -lim])


def test_window_e4m3_payload_rounding_hand_values():
    values = [1.0625, 1.1875, 232.0, 240.0, 2.0**-10, 3 * 2.0**-10, -1.0625, -232.0, 100.0]
    expected = [1.0, 1.25, 224.0, 240.0, 0.0, 2.0**-8, -1.0, -224.0, 96.0]
    out = _roundtrip(WINDOW, rows_with_amax(WINDOW, values, 448.0))  # scale 1
    np.testing.assert_array_equal(out[:, 1], np.float32(expected))
    # scale 2 (amax 896): 2.125 = 1.0625 * 2 ties to 2.0
    out2 = _roundtrip(WINDOW, rows_with_amax(WINDOW, [2.125, 2.375], 896.0))
    np.testing.assert_array_equal(out2[:, 1], [2.0, 2.5])


# ---------------------------------------------------------------------- reference / consistency


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("shape", [(32,), (3, 64), (2, 3, 128), (1, 512)])
def test_jit_fused_and_eager_roundtrip_agree_bitwise(fmt, shape):
    """dequantize(quantize(x)): separately jitted, fused in one jit and eager give the same bits."""
    x = jnp.asarray(random_blocks(fmt, shape, seed=len(shape)))
    ref = np.asarray(DQ(*Q(x, fmt), fmt)).view(np.uint32)
    fused = jax.jit(lambda x: formats.dequantize(*formats.quantize(x, fmt), fmt))(x)
    assert fused.dtype == jnp.float32 and fused.shape == shape
    np.testing.assert_array_equal(np.asarray(fused).view(np.uint32), ref)
    if shape == (3, 64):  # eager (op-by-op) execution agrees too
        eager = formats.dequantize(*formats.quantize(x, fmt), fmt)
        np.testing.assert_array_equal(np.asarray(eager).view(np.uint32), ref)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_matches_independent_numpy_reference(fmt):
    x = random_blocks(fmt, (8, 256), seed=1)
    got = _roundtrip(fmt, x)
    np.testing.assert_array_equal(got, _ref_fake_quant(fmt, x).astype(np.float32))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_scales_match_spec_formula(fmt):
    x = random_blocks(fmt, (4, 256), seed=2, lo=-30, hi=30)
    _, scales = Q(jnp.asarray(x), fmt)
    assert scales.dtype == fmt.scale_dtype and scales.shape == (4, 256 // fmt.block)
    np.testing.assert_array_equal(np.asarray(scales.astype(jnp.float32)), ref_scales(fmt, x))


@pytest.mark.parametrize(
    "fmt,k",
    [(INDEX, k) for k in (-120, -100, -3, 0, 1, 7, 100, 125)]
    + [(WINDOW, k) for k in (-20, -3, 0, 1, 7, 100, 119)],  # window floor: amax >= 1e-4
    ids=lambda v: v.name if isinstance(v, formats.QuantFormat) else str(v),
)
def test_ue8m0_scale_exact_at_powers_of_two(fmt, k):
    base = np.float32(fmt.payload_max * 2.0**k)  # amax = max * 2^k -> scale exactly 2^k
    amaxes = [base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(0))]
    x = np.stack([rows_with_amax(fmt, [0.0], a)[0] for a in amaxes])
    _, scales = Q(jnp.asarray(x), fmt)
    got = np.asarray(scales.astype(jnp.float32))[:, 0]
    np.testing.assert_array_equal(got, np.float32([2.0**k, 2.0 ** (k + 1), 2.0**k]))
    np.testing.assert_array_equal(got, ref_scales(fmt, x)[:, 0])


def test_main_scale_e4m3_rounding_and_floors():
    amaxes = [6.0, 6 * 1.0625, 6 * 1.1875, 6 * 2.0**-12, 0.0, 6 * 448.0, 6 * 500.0]
    expected = [1.0, 1.0, 1.25, 2.0**-9, 2.0**-9, 448.0, 448.0]
    x = np.stack([rows_with_amax(MAIN, [0.0], a)[0] for a in amaxes])
    _, scales = Q(jnp.asarray(x), MAIN)
    np.testing.assert_array_equal(np.asarray(scales.astype(jnp.float32))[:, 0], expected)


@pytest.mark.parametrize("fmt,floor", [(MAIN, 2.0**-9), (INDEX, 2.0**-126), (WINDOW, 2.0**-22)],
                         ids=["main", "index", "window"])
def test_zero_blocks_give_zeros_and_floor_scale(fmt, floor):
    x = np.zeros((2, 2 * fmt.block), np.float32)
    x[1, ::2] = -0.0
    payload, scales = Q(jnp.asarray(x), fmt)
    np.testing.assert_array_equal(np.asarray(scales.astype(jnp.float32)), floor)
    out = np.asarray(DQ(payload, scales, fmt))
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(np.signbit(out), np.signbit(x))  # -0.0 stays -0.0


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_negative_zero_and_small_negatives_stay_signed_zero(fmt):
    out = _roundtrip(fmt, rows_with_amax(fmt, [-0.0, -1e-6], 6.0))
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[:, 1], 0.0)
    assert np.all(np.signbit(out[:, 1]))


_F32_MAX = float(np.finfo(np.float32).max)  # rounds up to 2^128 in window; saturates back
# Expected value of the amax element: ("rel", bound) -> |rel err| <= bound; ("eq", v) -> exactly v
# (v = 0: below the format's resolution; 2688 = 6 * 448: main's saturation).
_EXTREMES = {
    "main": {1e-30: ("eq", 0.0), 1e-40: ("eq", 0.0), 1e30: ("eq", 2688.0), 3e38: ("eq", 2688.0)},
    "index": {1e-30: ("rel", 0.2), 1e-40: ("eq", 0.0), 1e30: ("rel", 0.2), 3e38: ("rel", 0.2)},
    "window": {1e-30: ("eq", 0.0), 1e-40: ("eq", 0.0), 1e30: ("rel", 2.0**-4),
               3e38: ("rel", 2.0**-4), _F32_MAX: ("rel", 2.0**-4)},
}


@pytest.mark.parametrize(
    "fmt,mag", [(f, m) for f in FORMATS for m in _EXTREMES[f.name]],
    ids=lambda v: v.name if isinstance(v, formats.QuantFormat) else f"{v:g}",
)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_tiny_and_huge_magnitudes_are_finite(fmt, mag, sign):
    rng = np.random.default_rng(3)
    base = rng.uniform(-0.7, 0.7, (3, fmt.block))
    base[:, 0] = [1.0, 0.83, 0.61]  # amax element, at varied positions in the e2m1/e4m3 grid
    x = (sign * mag * base).astype(np.float32)
    out = _roundtrip(fmt, x)
    assert np.isfinite(out).all()
    kind, val = _EXTREMES[fmt.name][mag]
    if kind == "eq":
        np.testing.assert_array_equal(out[:, 0], np.float32(sign * val))
    else:
        rel = np.abs(out[:, 0].astype(np.float64) / x[:, 0].astype(np.float64) - 1)
        assert np.all(rel <= val), rel


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_dequantize_dtype(fmt):
    x = jnp.asarray(random_blocks(fmt, (2, 64), seed=6))
    out = DQ(*Q(x, fmt), fmt, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(_roundtrip(fmt, x).astype(jnp.bfloat16), np.float32))


# ---------------------------------------------------------------------------- sizes and errors


@pytest.mark.parametrize("fmt,dim,nbytes", [(MAIN, 512, 288), (INDEX, 128, 68), (WINDOW, 512, 528)],
                         ids=["main", "index", "window"])
def test_packed_entry_sizes(fmt, dim, nbytes):
    payload, scales = Q(jnp.ones((dim,), jnp.float32), fmt)
    assert payload.nbytes + scales.nbytes == nbytes
    assert formats.entry_bytes(fmt, dim) == nbytes
    assert payload.shape == (dim * fmt.payload_bits // 8,) and scales.shape == (dim // fmt.block,)
    assert payload.dtype == (jnp.uint8 if fmt.payload_bits == 4 else jnp.float8_e4m3fn)
    assert fmt.payload_dtype == payload.dtype and fmt.payload_width(dim) == payload.shape[-1]


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_bad_last_dim_raises_naming_the_dim(fmt):
    bad = fmt.block + 8
    with pytest.raises(ValueError, match=rf"x\.shape\[-1\]={bad}.*multiple of {fmt.block}"):
        Q(jnp.ones((2, bad), jnp.float32), fmt)
    with pytest.raises(ValueError, match=rf"x\.shape\[-1\]={bad}.*multiple of {fmt.block}"):
        formats.scaled_blocks(jnp.ones((2, bad), jnp.float32), fmt)
    with pytest.raises(ValueError, match=rf"dim={bad}"):
        formats.entry_bytes(fmt, bad)
    with pytest.raises(ValueError, match="scalar"):
        formats.quantize(jnp.float32(1.0), fmt)
    payload, scales = Q(jnp.ones((2, 2 * fmt.block), jnp.float32), fmt)
    with pytest.raises(ValueError, match="scales.shape"):
        DQ(payload, scales[:, :1], fmt)
