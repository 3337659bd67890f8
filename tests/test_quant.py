"""Tests for csa2.quant: the SPEC §8 storage formats (main / index / window)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from csa2 import quant
from csa2.quant import INDEX, MAIN, WINDOW

FORMATS = [MAIN, INDEX, WINDOW]
FP4_FORMATS = [MAIN, INDEX]
IDS = lambda f: f.name  # noqa: E731
EAGER = {
    "main": (quant.quantize_main, quant.dequantize_main, quant.fake_quant_main),
    "index": (quant.quantize_index, quant.dequantize_index, quant.fake_quant_index),
    "window": (quant.quantize_window, quant.dequantize_window, quant.fake_quant_window),
}
# Jitted copies keep the suite fast (eager dispatch compiles every primitive separately).
TRIPLETS = {
    name: (jax.jit(q), jax.jit(dq, static_argnames="dtype"), jax.jit(fq))
    for name, (q, dq, fq) in EAGER.items()
}
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _roundtrip(fmt, x):
    """dequantize(quantize(x)) through the named public functions, as numpy float32."""
    q, dq, _ = TRIPLETS[fmt.name]
    return np.asarray(dq(*q(jnp.asarray(x, jnp.float32))))


def _rows_with_amax(fmt, values, amax):
    """One block per value: [amax, value, 0, ...], so every block has the same scale."""
    x = np.zeros((len(values), fmt.block), np.float32)
    x[:, 0] = amax
    x[:, 1] = values
    return x


def _ref_scales(fmt, x):
    """SPEC §8 scale formulas evaluated independently in float64 numpy / ml_dtypes."""
    xb = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, fmt.block)
    amax = np.abs(xb).max(-1)
    if fmt.name == "main":
        t = np.maximum(amax, 6 * 2.0**-9) / 6
        # Clamp to the e4m3 max before the cast (documented decision; ml_dtypes gives NaN).
        return np.minimum(t, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    if fmt.name == "index":
        return 2.0 ** np.ceil(np.log2(np.maximum(amax, 6 * 2.0**-126) / 6))
    return 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-4) / 448))


def _ref_fake_quant(fmt, x):
    """Independent float64 reference of dequantize(quantize(x))."""
    s = _ref_scales(fmt, x)[..., None]
    xb = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, fmt.block)
    lim = 6.0 if fmt.payload_bits == 4 else 448.0
    cast = ml_dtypes.float4_e2m1fn if fmt.payload_bits == 4 else ml_dtypes.float8_e4m3fn
    v = np.clip(xb / s, -lim, lim).astype(cast).astype(np.float64)
    return (v * s).reshape(x.shape)


def _random_blocks(fmt, shape, seed, lo=-20, hi=20):
    """Random normal data with a log-uniform magnitude 2^[lo, hi) per block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    mag = 2.0 ** rng.uniform(lo, hi, (*shape[:-1], shape[-1] // fmt.block, 1))
    return (x.reshape(*shape[:-1], -1, fmt.block) * mag).reshape(shape).astype(np.float32)


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
    out = _roundtrip(fmt, _rows_with_amax(fmt, values, 6.0))
    np.testing.assert_array_equal(out[:, 1], expected)
    np.testing.assert_array_equal(out[:, 0], 6.0)


@pytest.mark.parametrize("fmt", FP4_FORMATS, ids=IDS)
def test_fp4_nibble_order_low_nibble_is_even_element(fmt):
    x = np.zeros(fmt.block, np.float32)
    x[:8] = [0.5, 1.0, -6.0, 6.0, 0.0, -0.5, 3.0, 4.0]  # codes 1,2 | 15,7 | 0,9 | 5,6
    payload, _ = TRIPLETS[fmt.name][0](jnp.asarray(x))
    assert payload.dtype == jnp.uint8 and payload.shape == (fmt.block // 2,)
    expected = np.zeros(fmt.block // 2, np.uint8)
    expected[:4] = [0x21, 0x7F, 0x90, 0x65]
    np.testing.assert_array_equal(np.asarray(payload), expected)
    # and a hand-built payload decodes the same way
    ones = jnp.ones((1,), fmt.scale_dtype)
    dec = TRIPLETS[fmt.name][1](jnp.asarray(expected), ones)
    np.testing.assert_array_equal(np.asarray(dec), x)


# ------------------------------------------------------------------------------------- clamping


def test_main_clamps_when_e4m3_scale_rounds_down():
    # amax 6.36: 6.36 / 6 = 1.06 rounds to the e4m3 scale 1.0, so 6.36 / scale > 6 -> clamp.
    out = _roundtrip(MAIN, _rows_with_amax(MAIN, [1.0, -2.0], 6.36))
    np.testing.assert_array_equal(out[:, 0], 6.0)
    np.testing.assert_array_equal(out[:, 1], [1.0, -2.0])
    neg = _roundtrip(MAIN, -_rows_with_amax(MAIN, [1.0], 6.36))
    assert neg[0, 0] == -6.0


def test_main_saturates_scale_and_payload_for_huge_amax():
    x = _rows_with_amax(MAIN, [1e29, -1e30], 1e30)
    _, scales = quant.quantize_main(jnp.asarray(x))
    assert np.all(np.asarray(scales.astype(jnp.float32)) == 448.0)
    np.testing.assert_array_equal(_roundtrip(MAIN, x)[:, :2], [[2688.0, 2688.0], [2688.0, -2688.0]])


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_payload_encoder_clamps_out_of_range_values(fmt):
    # ue8m0 scales round up, so index/window never produce |x/scale| > max through quantize; the
    # explicit clamp is tested on the encoder directly (an unclamped e4m3 cast gives NaN).
    lim = fmt.payload_max
    v = np.zeros((1, fmt.block), np.float32)
    v[0, :4] = [lim * 1.2, -lim * 1.2, 1e30, -3e38]
    payload = quant._encode(jnp.asarray(v)[None], fmt)
    out = np.asarray(quant.dequantize(payload, jnp.ones((1, 1), fmt.scale_dtype), fmt))
    np.testing.assert_array_equal(out[0, :4], [lim, -lim, lim, -lim])


def test_window_e4m3_payload_rounding_hand_values():
    values = [1.0625, 1.1875, 232.0, 240.0, 2.0**-10, 3 * 2.0**-10, -1.0625, -232.0, 100.0]
    expected = [1.0, 1.25, 224.0, 240.0, 0.0, 2.0**-8, -1.0, -224.0, 96.0]
    out = _roundtrip(WINDOW, _rows_with_amax(WINDOW, values, 448.0))  # scale 1
    np.testing.assert_array_equal(out[:, 1], np.float32(expected))
    # scale 2 (amax 896): 2.125 = 1.0625 * 2 ties to 2.0
    out2 = _roundtrip(WINDOW, _rows_with_amax(WINDOW, [2.125, 2.375], 896.0))
    np.testing.assert_array_equal(out2[:, 1], [2.0, 2.5])


# ---------------------------------------------------------------------- reference / consistency


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("shape", [(32,), (3, 64), (2, 3, 128), (1, 512)])
def test_fake_quant_is_bitwise_dequantize_of_quantize(fmt, shape):
    q, dq, fq = TRIPLETS[fmt.name]
    x = jnp.asarray(_random_blocks(fmt, shape, seed=len(shape)))
    ref = np.asarray(dq(*q(x))).view(np.uint32)
    fused = jax.jit(lambda x: EAGER[fmt.name][1](*EAGER[fmt.name][0](x)))(x)
    for got in (fq(x), fused):
        assert got.dtype == jnp.float32 and got.shape == shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), ref)
    if shape == (3, 64):  # eager (op-by-op) execution agrees too
        eq, edq, efq = EAGER[fmt.name]
        np.testing.assert_array_equal(np.asarray(efq(x)).view(np.uint32), ref)
        np.testing.assert_array_equal(np.asarray(edq(*eq(x))).view(np.uint32), ref)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_matches_independent_numpy_reference(fmt):
    x = _random_blocks(fmt, (8, 256), seed=1)
    got = _roundtrip(fmt, x)
    np.testing.assert_array_equal(got, _ref_fake_quant(fmt, x).astype(np.float32))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_scales_match_spec_formula(fmt):
    x = _random_blocks(fmt, (4, 256), seed=2, lo=-30, hi=30)
    _, scales = TRIPLETS[fmt.name][0](jnp.asarray(x))
    assert scales.dtype == fmt.scale_dtype and scales.shape == (4, 256 // fmt.block)
    np.testing.assert_array_equal(np.asarray(scales.astype(jnp.float32)), _ref_scales(fmt, x))


@pytest.mark.parametrize(
    "fmt,k",
    [(INDEX, k) for k in (-120, -100, -3, 0, 1, 7, 100, 125)]
    + [(WINDOW, k) for k in (-20, -3, 0, 1, 7, 100, 119)],  # window floor: amax >= 1e-4
    ids=lambda v: v.name if isinstance(v, quant.QuantFormat) else str(v),
)
def test_ue8m0_scale_exact_at_powers_of_two(fmt, k):
    base = np.float32(fmt.payload_max * 2.0**k)  # amax = max * 2^k -> scale exactly 2^k
    amaxes = [base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(0))]
    x = np.stack([_rows_with_amax(fmt, [0.0], a)[0] for a in amaxes])
    _, scales = TRIPLETS[fmt.name][0](jnp.asarray(x))
    got = np.asarray(scales.astype(jnp.float32))[:, 0]
    np.testing.assert_array_equal(got, np.float32([2.0**k, 2.0 ** (k + 1), 2.0**k]))
    np.testing.assert_array_equal(got, _ref_scales(fmt, x)[:, 0])


def test_main_scale_e4m3_rounding_and_floors():
    amaxes = [6.0, 6 * 1.0625, 6 * 1.1875, 6 * 2.0**-12, 0.0, 6 * 448.0, 6 * 500.0]
    expected = [1.0, 1.0, 1.25, 2.0**-9, 2.0**-9, 448.0, 448.0]
    x = np.stack([_rows_with_amax(MAIN, [0.0], a)[0] for a in amaxes])
    _, scales = quant.quantize_main(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(scales.astype(jnp.float32))[:, 0], expected)


@pytest.mark.parametrize("fmt,floor", [(MAIN, 2.0**-9), (INDEX, 2.0**-126), (WINDOW, 2.0**-22)],
                         ids=["main", "index", "window"])
def test_zero_blocks_give_zeros_and_floor_scale(fmt, floor):
    x = np.zeros((2, 2 * fmt.block), np.float32)
    x[1, ::2] = -0.0
    payload, scales = TRIPLETS[fmt.name][0](jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(scales.astype(jnp.float32)), floor)
    out = np.asarray(TRIPLETS[fmt.name][1](payload, scales))
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(np.signbit(out), np.signbit(x))  # -0.0 stays -0.0


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_negative_zero_and_small_negatives_stay_signed_zero(fmt):
    out = _roundtrip(fmt, _rows_with_amax(fmt, [-0.0, -1e-6], 6.0))
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
    ids=lambda v: v.name if isinstance(v, quant.QuantFormat) else f"{v:g}",
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


# ------------------------------------------------------------------------------------------ STE


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_ste_gradient_is_identity_inside_clamp_range(fmt):
    fq = TRIPLETS[fmt.name][2]
    x = _random_blocks(fmt, (4, 128), seed=4)
    w = np.random.default_rng(5).standard_normal(x.shape).astype(np.float32)
    g = np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(fq(x) * w)))(jnp.asarray(x)))
    scaled = np.abs(x.reshape(4, -1, fmt.block) / _ref_scales(fmt, x)[..., None]).reshape(x.shape)
    in_range = scaled <= fmt.payload_max
    np.testing.assert_array_equal(g, np.where(in_range, w, 0.0))
    if fmt is MAIN:
        assert not in_range.all()  # the random data does exercise main's clamp
    else:
        assert in_range.all()  # ue8m0 scales round up: index/window can never clamp


def test_ste_gradient_zero_where_main_clamps():
    x = _rows_with_amax(MAIN, [6.0], 6.36)  # 6.36 clamps (scale 1.0); 6.0 sits exactly on the max
    x = np.concatenate([x, _rows_with_amax(MAIN, [-6.0], 6.0)])
    w = np.arange(1, x.size + 1, dtype=np.float32).reshape(x.shape)
    g = np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(quant.fake_quant_main(x) * w)))(x))
    expected = w.copy()
    expected[0, 0] = 0.0
    np.testing.assert_array_equal(g, expected)


def test_fake_quant_keeps_input_dtype():
    q, dq, fq = TRIPLETS["index"]
    x = jnp.asarray(_random_blocks(INDEX, (2, 64), seed=6), jnp.bfloat16)
    out = fq(x)
    assert out.dtype == jnp.bfloat16
    ref = dq(*q(x), dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    assert jax.jit(jax.grad(lambda x: fq(x).sum()))(x).dtype == jnp.bfloat16


# ---------------------------------------------------------------------------- sizes and errors


@pytest.mark.parametrize("fmt,dim,nbytes", [(MAIN, 512, 288), (INDEX, 128, 68), (WINDOW, 512, 528)],
                         ids=["main", "index", "window"])
def test_packed_entry_sizes(fmt, dim, nbytes):
    payload, scales = TRIPLETS[fmt.name][0](jnp.ones((dim,), jnp.float32))
    assert payload.nbytes + scales.nbytes == nbytes
    assert quant.entry_bytes(fmt, dim) == nbytes
    assert payload.shape == (dim * fmt.payload_bits // 8,) and scales.shape == (dim // fmt.block,)
    assert payload.dtype == (jnp.uint8 if fmt.payload_bits == 4 else jnp.float8_e4m3fn)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_bad_last_dim_raises_naming_the_dim(fmt):
    q, dq, fq = TRIPLETS[fmt.name]
    bad = fmt.block + 8
    for fn in (q, fq):
        with pytest.raises(ValueError, match=rf"x\.shape\[-1\]={bad}.*multiple of {fmt.block}"):
            fn(jnp.ones((2, bad), jnp.float32))
    with pytest.raises(ValueError, match=rf"dim={bad}"):
        quant.entry_bytes(fmt, bad)
    payload, scales = q(jnp.ones((2, 2 * fmt.block), jnp.float32))
    with pytest.raises(ValueError, match="scales.shape"):
        dq(payload, scales[:, :1])
