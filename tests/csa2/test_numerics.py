"""The inference numerics (`csa2.quant.NUMERICS`): "float" runs the float model at every entry point, so decode
agrees with the float teacher-forced forward to float rounding, and nothing it stores sits on the FP4/FP8 grids;
"spec" (the default) stores exactly the SPEC §8 values. Bad choices are refused at the boundary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import model
from csa2.presets import preset
from csa2.quant import INDEX, MAIN, WINDOW, fake_quant
from csa2.state import init_state
from infer import generate as gen
from infer.speculative import speculative_generate

MINI = preset("mini")


def _decode(params, prompt, steps, numerics):
    """Teacher-forced decode of `prompt [B, 1 + steps]` after a one-token prefill: logits [B, steps + 1, V], state."""
    state = init_state(MINI, prompt.shape[0], 64, "float")
    logits, state, _ = model.prefill(MINI, params, state, prompt[:, :1], numerics=numerics)
    out = [logits]
    for k in range(1, steps + 1):
        logits, state = model.decode_step(MINI, params, state, prompt[:, k], numerics)
        out.append(logits)
    return jnp.stack(out, 1), state


@pytest.mark.cross_shape
def test_float_numerics_decode_equals_the_float_forward(mini_params):
    """Step-by-step decode with numerics="float" ≡ the float model's teacher-forced `forward(qat=False)` to float
    rounding (1e-5) across the ring wrap (21 slots) and every ratio-2 boundary; the SPEC §8 numerics are a
    different model: their decode is ~1e-2 away from the float forward."""
    prompt = jax.random.randint(jax.random.PRNGKey(3), (2, 26), 0, 256, jnp.int32)
    logits, _ = _decode(mini_params, prompt, 25, "float")
    ref, _ = model.forward(MINI, mini_params, prompt, qat=False)
    err = float(jnp.abs(logits - ref).max())
    spec, _ = _decode(mini_params, prompt, 25, "spec")
    spec_err = float(jnp.abs(spec - ref).max())
    print(f"\nmax |decode - float forward|: float numerics {err:.2e}, SPEC §8 numerics {spec_err:.2e}")
    assert err <= 1e-5
    assert spec_err > 100 * err


def test_spec_numerics_store_grid_values_and_float_numerics_do_not(mini_params):
    """Under "spec" every stored Main KV, Indexer K, SWA window and drafter context entry is a fixed point of its
    format's fake-quant (what the packed cache holds); under "float" almost none is."""
    prompt = jax.random.randint(jax.random.PRNGKey(4), (2, 20), 0, 256, jnp.int32)
    on_grid = {}
    for numerics in ("spec", "float"):
        _, state = _decode(mini_params, prompt, 19, numerics)
        ratio2 = state.global_kv[0]  # the ratio-2 stack's 10 complete entries
        stored = ((ratio2.kv.payload[:, :, :10], MAIN), (ratio2.ikey.payload[:, :, :10], INDEX),
                  (state.swa.payload, WINDOW), (state.draft.payload[:, :, :20], WINDOW))
        on_grid[numerics] = [float(jnp.mean(fake_quant(x, fmt) == x)) for x, fmt in stored]
    assert on_grid["spec"] == [1.0] * 4
    assert max(on_grid["float"]) < 0.1


@pytest.mark.parametrize("call, message", [
    (lambda p: model.prefill(MINI, p, init_state(MINI, 1, 16, "float"), jnp.zeros((1, 4), jnp.int32),
                             numerics="fp32"), "numerics='fp32'"),
    (lambda p: model.decode_step(MINI, p, init_state(MINI, 1, 16), jnp.zeros((1,), jnp.int32), "float"),
     "cache_format='fp4'"),
    (lambda p: model.draft(MINI, p, init_state(MINI, 1, 16), jnp.zeros((1,), jnp.int32), jax.random.PRNGKey(0),
                           numerics="float"), "cache_format='float'"),
    (lambda p: gen.generate(MINI, p, [[1, 2]], max_new_tokens=2, numerics="float", cache_format="fp4"),
     "numerics='float' with cache_format='fp4'"),
    (lambda p: speculative_generate(MINI, p, [[1, 2]], max_new_tokens=2, numerics="half"), "numerics='half'"),
])
def test_bad_numerics_are_refused(mini_params, call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        call(mini_params)


def test_generate_takes_the_float_cache_with_the_float_numerics(mini_params):
    """`generate(numerics="float")` picks the float cache itself, and its greedy tokens are the host loop's."""
    prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(5), (2, 6), 0, 256, jnp.int32))
    out = gen.generate(MINI, mini_params, prompt, max_new_tokens=4, eos_id=None, numerics="float")
    assert not out.state.swa.packed
    state = init_state(MINI, 2, 16, "float")
    logits, state, _ = model.prefill(MINI, mini_params, state, jnp.asarray(prompt), numerics="float")
    want = []
    for _ in range(4):
        token = jnp.argmax(logits, -1).astype(jnp.int32)
        want.append(token)
        logits, state = model.decode_step(MINI, mini_params, state, token, "float")
    np.testing.assert_array_equal(out.tokens, np.stack(want, 1))
