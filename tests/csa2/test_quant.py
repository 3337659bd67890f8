"""Tests for csa2.quant: straight-through fake quantization in the SPEC §8 formats.

The formats themselves (quantize / dequantize / scales / bits) are tested in
tests/pallas_kernels/test_formats.py, where they live.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import quant
from csa2.quant import INDEX, MAIN, WINDOW
from pallas_kernels import formats
from tests.pallas_kernels.cases import random_blocks, ref_scales, rows_with_amax

FORMATS = [MAIN, INDEX, WINDOW]
IDS = lambda f: f.name  # noqa: E731
# Jitted copies keep the suite fast (eager dispatch compiles every primitive separately).
Q = jax.jit(formats.quantize, static_argnums=1)
DQ = jax.jit(formats.dequantize, static_argnums=2, static_argnames="dtype")
FQ = jax.jit(quant.fake_quant, static_argnums=1)


def test_reexports_the_formats():
    assert (quant.MAIN, quant.INDEX, quant.WINDOW) == (formats.MAIN, formats.INDEX, formats.WINDOW)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("shape", [(32,), (3, 64), (2, 3, 128), (1, 512)])
def test_fake_quant_is_bitwise_dequantize_of_quantize(fmt, shape):
    x = jnp.asarray(random_blocks(fmt, shape, seed=len(shape)))
    ref = np.asarray(DQ(*Q(x, fmt), fmt)).view(np.uint32)
    fused = jax.jit(lambda x: formats.dequantize(*formats.quantize(x, fmt), fmt))(x)
    for got in (FQ(x, fmt), fused):
        assert got.dtype == jnp.float32 and got.shape == shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), ref)
    if shape == (3, 64):  # eager (op-by-op) execution agrees too
        np.testing.assert_array_equal(np.asarray(quant.fake_quant(x, fmt)).view(np.uint32), ref)
        np.testing.assert_array_equal(np.asarray(formats.dequantize(*formats.quantize(x, fmt), fmt)).view(np.uint32),
                                      ref)


# ------------------------------------------------------------------------------------------ STE


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_ste_gradient_is_identity_inside_clamp_range(fmt):
    x = random_blocks(fmt, (4, 128), seed=4)
    w = np.random.default_rng(5).standard_normal(x.shape).astype(np.float32)
    g = np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(quant.fake_quant(x, fmt) * w)))(jnp.asarray(x)))
    scaled = np.abs(x.reshape(4, -1, fmt.block) / ref_scales(fmt, x)[..., None]).reshape(x.shape)
    in_range = scaled <= fmt.payload_max
    np.testing.assert_array_equal(g, np.where(in_range, w, 0.0))
    if fmt is MAIN:
        assert not in_range.all()  # the random data does exercise main's clamp
    else:
        assert in_range.all()  # ue8m0 scales round up: index/window can never clamp


def test_ste_gradient_zero_where_main_clamps():
    x = rows_with_amax(MAIN, [6.0], 6.36)  # 6.36 clamps (scale 1.0); 6.0 sits exactly on the max
    x = np.concatenate([x, rows_with_amax(MAIN, [-6.0], 6.0)])
    w = np.arange(1, x.size + 1, dtype=np.float32).reshape(x.shape)
    g = np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(quant.fake_quant(x, MAIN) * w)))(x))
    expected = w.copy()
    expected[0, 0] = 0.0
    np.testing.assert_array_equal(g, expected)


def test_fake_quant_keeps_input_dtype():
    x = jnp.asarray(random_blocks(INDEX, (2, 64), seed=6), jnp.bfloat16)
    out = FQ(x, INDEX)
    assert out.dtype == jnp.bfloat16
    ref = DQ(*Q(x, INDEX), INDEX, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    assert jax.jit(jax.grad(lambda x: FQ(x, INDEX).sum()))(x).dtype == jnp.bfloat16


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_bad_last_dim_raises_naming_the_dim(fmt):
    bad = fmt.block + 8
    with pytest.raises(ValueError, match=rf"x\.shape\[-1\]={bad}.*multiple of {fmt.block}"):
        FQ(jnp.ones((2, bad), jnp.float32), fmt)
