"""pallas_kernels.stored.Stored: hand cases for empty, gather, write, reshape_rows, concat_rows, pytree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import formats
from pallas_kernels.formats import INDEX, MAIN, WINDOW
from pallas_kernels.stored import Stored, concat_rows
from tests.pallas_kernels.cases import np_dequantize

FORMATS = [MAIN, INDEX, WINDOW]
IDS = lambda f: f.name  # noqa: E731


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _same_bits(a, b):
    """Same bytes (a packed Stored holds uint8 bits of the float8 values `formats.quantize` returns)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype.itemsize == b.dtype.itemsize and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# --- construction ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_empty_packed_has_unit_scales(fmt):
    st = Stored.empty((2, 3), 64, fmt, packed=True)
    assert st.packed and st.dim == 64 and st.rows == 3 and st.fmt == fmt
    # packed buffers hold raw bytes (no float8 arrays: XLA:CPU converts those through f16 on every move)
    assert st.payload.shape == (2, 3, fmt.payload_width(64)) and st.payload.dtype == jnp.uint8
    assert st.scale.shape == (2, 3, 64 // fmt.block) and st.scale.dtype == jnp.uint8
    scale = jax.lax.bitcast_convert_type(st.scale, fmt.scale_dtype).astype(jnp.float32)
    np.testing.assert_array_equal(scale, 1.0)  # 1, not 0 (ue8m0 has no 0)
    np.testing.assert_array_equal(np.asarray(st.payload).view(np.uint8), 0)
    dec = np.asarray(st.decode())
    assert dec.shape == (2, 3, 64) and not np.isnan(dec).any()
    np.testing.assert_array_equal(dec, 0.0)
    np.testing.assert_array_equal(np_dequantize(st.payload, st.scale, fmt.name), 0.0)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_empty_float(fmt):
    st = Stored.empty((2, 3), 64, fmt, packed=False)
    assert not st.packed and st.scale is None and st.dim == 64 and st.rows == 3
    assert st.payload.shape == (2, 3, 64) and st.payload.dtype == jnp.float32
    np.testing.assert_array_equal(st.decode(), 0.0)
    data, scale = st.bits()
    assert data is st.payload and scale is None


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_quantized_and_bits(fmt):
    x = _x(0, (2, 5, 64))
    st = Stored.quantized(x, fmt)
    payload, scales = formats.quantize(x, fmt)
    _same_bits(st.payload, payload)
    _same_bits(st.scale, scales)
    assert st.packed and st.dim == 64 and st.rows == 5
    pb, sb = st.bits()
    assert pb.dtype == jnp.uint8 and sb.dtype == jnp.uint8
    np.testing.assert_array_equal(pb, np.asarray(payload).view(np.uint8))
    np.testing.assert_array_equal(sb, np.asarray(scales).view(np.uint8))
    np.testing.assert_array_equal(st.decode(), np_dequantize(payload, scales, fmt.name).astype(np.float32))


# --- gather -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_gather_out_of_range_reads_row_zero(fmt):
    st = Stored.quantized(_x(1, (2, 4, 64)), fmt)
    rows = np.asarray(st.decode())  # [2, 4, 64]
    idx = jnp.asarray([[[2, -1], [4, 0]], [[3, 99], [-7, 1]]], jnp.int32)  # [B=2, 2, 2]
    got = np.asarray(st.gather(idx))
    assert got.shape == (2, 2, 2, 64) and got.dtype == np.float32
    safe = np.where((np.asarray(idx) >= 0) & (np.asarray(idx) < 4), np.asarray(idx), 0)
    want = np.stack([rows[b][safe[b]] for b in range(2)])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[0, 0, 1], rows[0, 0])  # −1 → row 0 (not row 3)
    np.testing.assert_array_equal(got[0, 1, 0], rows[0, 0])  # = rows → row 0 (not clipped to row 3)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_packed_gather_equals_gather_of_decoded_buffer(fmt):
    st = Stored.quantized(_x(2, (3, 7, 64)) * 5, fmt)
    as_float = Stored(st.decode(), None, fmt)
    idx = jnp.asarray(np.random.default_rng(3).integers(-2, 9, (3, 4, 5)), jnp.int32)
    got, want = st.gather(idx), as_float.gather(idx)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


# --- write ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("packed", [True, False])
def test_write_drops_invalid_never_clips(packed):
    fmt = MAIN
    buf = Stored.empty((2, 4), 32, fmt, packed)
    x = _x(4, (2, 3, 32)) + 3.0
    entries = Stored.quantized(x, fmt) if packed else Stored(x, None, fmt)
    idx = jnp.asarray([[1, 3, 2], [4, 0, 9]], jnp.int32)
    valid = jnp.asarray([[True, True, False], [True, True, True]])
    out = buf.write(idx, entries, valid)
    assert out.fmt == fmt and out.packed == packed and out.payload.shape == buf.payload.shape
    dec, ent = np.asarray(out.decode()), np.asarray(entries.decode())
    np.testing.assert_array_equal(dec[0, 1], ent[0, 0])
    np.testing.assert_array_equal(dec[0, 3], ent[0, 1])
    np.testing.assert_array_equal(dec[0, [0, 2]], 0.0)  # invalid write at row 2 dropped
    np.testing.assert_array_equal(dec[1, 0], ent[1, 1])
    np.testing.assert_array_equal(dec[1, 1:], 0.0)  # ids 4 and 9 ≥ rows: dropped, not clipped onto row 3
    if packed:  # unwritten rows keep the unit scales of `empty`
        scale = jax.lax.bitcast_convert_type(out.scale, fmt.scale_dtype).astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(scale)[1, 1:], 1.0)
        _same_bits(out.payload[0, 1], entries.payload[0, 0])
        _same_bits(out.scale[0, 1], entries.scale[0, 0])


def test_write_format_mismatch_raises():
    buf = Stored.empty((1, 4), 32, MAIN, True)
    idx, valid = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)
    x = _x(5, (1, 1, 32))
    with pytest.raises(ValueError, match="format"):
        buf.write(idx, Stored.quantized(x, INDEX), valid)  # other format
    with pytest.raises(ValueError, match="format"):
        buf.write(idx, Stored(x, None, MAIN), valid)  # float entries into a packed buffer
    with pytest.raises(ValueError, match="format"):
        Stored.empty((1, 4), 32, MAIN, False).write(idx, Stored.quantized(x, MAIN), valid)  # and back


# --- reshape_rows, concat_rows -------------------------------------------------------------------

@pytest.mark.parametrize("packed", [True, False])
def test_reshape_rows(packed):
    x = _x(6, (2, 3, 5, 32))
    st = Stored.quantized(x, MAIN) if packed else Stored(x, None, MAIN)
    flat = st.reshape_rows(2, 15)
    assert flat.rows == 15 and flat.dim == 32 and flat.fmt == MAIN and flat.packed == packed
    assert flat.payload.shape[:2] == (2, 15) and (not packed or flat.scale.shape == (2, 15, 2))
    np.testing.assert_array_equal(flat.decode(), np.asarray(st.decode()).reshape(2, 15, 32))
    back = flat.reshape_rows(2, 3, 5)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(st)):
        _same_bits(a, b)


@pytest.mark.parametrize("packed", [True, False])
def test_concat_rows(packed):
    xa, xb = _x(7, (2, 3, 64)), _x(8, (2, 2, 64))
    make = (lambda x: Stored.quantized(x, WINDOW)) if packed else (lambda x: Stored(x, None, WINDOW))
    a, b = make(xa), make(xb)
    c = concat_rows(a, b)
    assert c.rows == 5 and c.fmt == WINDOW and c.packed == packed
    np.testing.assert_array_equal(c.decode(), np.concatenate([a.decode(), b.decode()], axis=1))
    if packed:
        _same_bits(c.scale[:, 3:], b.scale)


# --- pytree -------------------------------------------------------------------------------------------

def test_stored_is_a_pytree_with_static_format():
    st = Stored.quantized(_x(9, (2, 4, 32)), INDEX)
    leaves, treedef = jax.tree.flatten(st)
    assert len(leaves) == 2 and leaves[0] is st.payload and leaves[1] is st.scale  # fmt is not a leaf
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert isinstance(rebuilt, Stored) and rebuilt.fmt is INDEX and rebuilt.payload is st.payload
    assert len(jax.tree.leaves(Stored(_x(9, (2, 4, 32)), None, INDEX))) == 1  # float storage: scale None
    # fmt is static metadata: two formats give two tree structures
    assert jax.tree.structure(st) != jax.tree.structure(Stored(st.payload, st.scale, WINDOW))

    seen = []

    @jax.jit
    def f(s):
        seen.append(s.fmt)  # a plain QuantFormat inside jit, not a tracer
        assert isinstance(s.fmt, formats.QuantFormat)
        return Stored(s.payload, s.scale, s.fmt), s.decode()

    out, dec = f(st)
    assert isinstance(out, Stored) and out.fmt is INDEX and seen == [INDEX]
    _same_bits(out.payload, st.payload)
    np.testing.assert_array_equal(dec, st.decode())
    f(st)
    assert len(seen) == 1  # same format, same shapes: no retrace
    f(Stored.quantized(_x(10, (2, 4, 32)), MAIN))
    assert seen == [INDEX, MAIN]  # another format: retraced with that format

    sliced = jax.tree.map(lambda a: a[:, 1:3], st)  # slicing reaches payload and scale together
    assert isinstance(sliced, Stored) and sliced.fmt is INDEX and sliced.rows == 2
    assert sliced.scale.shape == (2, 2, 1)
    np.testing.assert_array_equal(sliced.decode(), np.asarray(st.decode())[:, 1:3])
    stacked = jax.tree.map(lambda *a: jnp.stack(a, 1), st, st)
    assert stacked.payload.shape == (2, 2, 4, 16) and stacked.scale.shape == (2, 2, 4, 1)
