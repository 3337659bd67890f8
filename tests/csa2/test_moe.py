"""MoE (SPEC §9): routing, correction biases, SwiGLU clamps, load, bias update, both dispatch paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from csa2.moe import MoE, RouterBias, bias_update, moe, route
from csa2.presets import preset

# `mini`: d = 64, 8 routed experts top-2, I = 64, float32. A larger init spreads the router scores
# and makes the expert outputs O(1), so mistakes are visible.
CFG = preset("mini").replace(initializer_range=0.2)
D, E, K = CFG.hidden_size, CFG.n_routed_experts, CFG.num_experts_per_tok
RSF = CFG.routed_scaling_factor

_moe = jax.jit(moe, static_argnums=0, static_argnames="dispatch")
_route = jax.jit(route, static_argnums=0)


def _params(seed=0, bias_std=0.0):
    p = nnx.to_pure_dict(nnx.state(MoE(CFG, rngs=nnx.Rngs(jax.random.key(seed)))))
    if bias_std:
        p["bias"] = bias_std * jax.random.normal(jax.random.key(seed + 100), (E,))
    return p


def _x(shape, seed=1, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), (*shape, D), jnp.float32)


def _assert_same_sums(got, want):
    """The two dispatch paths add the same products in different orders: equal to 4 ulps of the output's scale
    (the order also differs between XLA:CPU's optimization levels; the suite compiles at -O0, `conftest`)."""
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * np.spacing(np.abs(np.asarray(want)).max()))


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _numpy_moe(p, x, weights, experts, limit, gate_both_sides=False):
    """Loop reference: one expert at a time, per (token, slot), plus the shared expert. Float64."""
    x = np.asarray(x, np.float64).reshape(-1, D)
    w1, w3, w2 = (np.asarray(p[n], np.float64) for n in ("w1", "w3", "w2"))
    weights, experts = np.asarray(weights, np.float64), np.asarray(experts)

    def expert(v, a, b, c):
        g, u = v @ a, v @ b
        g = np.clip(g, -limit, limit) if gate_both_sides else np.minimum(g, limit)
        return (_silu(g) * np.clip(u, -limit, limit)) @ c

    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = experts[t, j]
            y[t] += weights[t, j] * expert(x[t], w1[e], w3[e], w2[e])
    s = p["shared"]
    return y + expert(x, *(np.asarray(s[n], np.float64) for n in ("w1", "w3", "w2")))


def test_module_declares_params_and_router_biases():
    """The correction biases are `RouterBias` variables (zeros, not `nnx.Param`): the optimizer skips them by type."""
    state = nnx.state(MoE(CFG, rngs=nnx.Rngs(0)))
    kinds = {path: type(v) for path, v in nnx.to_flat_state(state)}
    assert kinds == {("router",): nnx.Param, ("bias",): RouterBias, ("bias_vl",): RouterBias,
                     ("w1",): nnx.Param, ("w3",): nnx.Param, ("w2",): nnx.Param,
                     ("shared", "w1"): nnx.Param, ("shared", "w3"): nnx.Param, ("shared", "w2"): nnx.Param}
    assert not issubclass(RouterBias, nnx.Param)
    p = nnx.to_pure_dict(state)
    assert p["router"].shape == (D, E) and p["w1"].shape == p["w3"].shape == (E, D, CFG.moe_intermediate_size)
    assert p["w2"].shape == (E, CFG.moe_intermediate_size, D)
    np.testing.assert_array_equal(p["bias"], np.zeros(E, np.float32))
    np.testing.assert_array_equal(p["bias_vl"], np.zeros(E, np.float32))
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(p))


# Up to 34 pairs run `ragged_dot`; (2, 33) and (4, 75) run 4- and 16-row tiles with padded groups.
@pytest.mark.parametrize("shape", [(1,), (3, 5), (17,), (2, 33), (4, 75)])
def test_dispatch_paths_agree(shape):
    p, x = _params(bias_std=0.3), _x(shape)
    y_dense, load_dense = _moe(CFG, p, x, dispatch="dense")
    y_ragged, load_ragged = _moe(CFG, p, x, dispatch="ragged")
    assert y_dense.shape == x.shape and y_dense.dtype == jnp.float32
    assert float(jnp.abs(y_dense).max()) > 0.1
    _assert_same_sums(y_ragged, y_dense)
    np.testing.assert_array_equal(load_ragged, load_dense)


def test_ragged_dispatch_with_empty_and_crowded_experts():
    """A bias that sends every token to experts 0 and 1 leaves six groups empty and two full."""
    p, x = _params(), _x((300,))
    p["bias"] = jnp.zeros((E,)).at[:2].set(100.0)
    y_dense, load = _moe(CFG, p, x, dispatch="dense")
    y_ragged, _ = _moe(CFG, p, x, dispatch="ragged")
    np.testing.assert_array_equal(load, np.array([0.5, 0.5] + [0.0] * (E - 2), np.float32))
    _assert_same_sums(y_ragged, y_dense)


def test_route_scores_and_weights():
    cfg = CFG.replace(gate_temp=2.0)
    p, x = _params(), _x((2, 6))
    weights, experts, scores = _route(cfg, p, x)
    assert weights.shape == experts.shape == (12, K) and scores.shape == (12, E) and experts.dtype == jnp.int32
    logits = np.asarray(x, np.float64).reshape(-1, D) @ np.asarray(p["router"], np.float64) / 2.0
    np.testing.assert_allclose(scores, np.sqrt(np.log1p(np.exp(logits))), rtol=1e-6)
    np.testing.assert_array_equal(np.sort(experts, -1), np.sort(np.argsort(-np.asarray(scores), -1)[:, :K], -1))
    np.testing.assert_allclose(weights.sum(-1), RSF, rtol=1e-6)
    assert bool((weights > 0).all())


def test_bias_changes_selection_not_weights():
    p, x = _params(), _x((16,))
    w0, e0, s0 = _route(CFG, p, x)
    p["bias"] = p["bias"].at[3].set(100.0)
    w1, e1, s1 = _route(CFG, p, x)
    np.testing.assert_array_equal(s1, s0)
    assert bool((e1 == 3).any(-1).all()), "a large bias on expert 3 makes every token pick it"
    assert not bool((e0 == 3).any(-1).all()), "without the bias some tokens do not pick expert 3"
    picked = np.take_along_axis(np.asarray(s0), np.asarray(e1), -1)  # unbiased scores of the new selection
    np.testing.assert_allclose(w1, picked / picked.sum(-1, keepdims=True) * RSF, rtol=1e-6)
    same = (np.sort(e0, -1) == np.sort(e1, -1)).all(-1)
    assert same.any()  # tokens that already picked expert 3 keep their weights exactly
    np.testing.assert_array_equal(np.sort(w1, -1)[same], np.sort(w0, -1)[same])


def test_bias_vl_only_on_image_tokens():
    p, x = _params(), _x((2, 4))
    p["bias_vl"] = p["bias_vl"].at[5].set(100.0)
    mask = jnp.array([[True, False, True, False], [False, False, True, True]])
    _, e_text, _ = _route(CFG, p, x)
    _, e_none, _ = _route(CFG, p, x, jnp.zeros_like(mask))
    _, e_mix, _ = _route(CFG, p, x, mask)
    np.testing.assert_array_equal(e_none, e_text)
    flat = np.asarray(mask).reshape(-1)
    assert bool((e_mix[flat] == 5).any(-1).all())
    np.testing.assert_array_equal(e_mix[~flat], e_text[~flat])
    assert not bool((e_text[flat] == 5).any(-1).all())


def test_clamps_against_numpy_loop():
    """Huge inputs: the gate is clamped from above only, the up projection on both sides."""
    p, x = _params(seed=2), _x((6,), seed=3, scale=30.0)
    weights, experts, _ = _route(CFG, p, x)
    y, _ = _moe(CFG, p, x, dispatch="ragged")
    ref = _numpy_moe(p, x, weights, experts, CFG.swiglu_limit)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
    gate = np.einsum("td,edi->tei", np.asarray(x), np.asarray(p["w1"]))
    up = np.einsum("td,edi->tei", np.asarray(x), np.asarray(p["w3"]))
    lim = CFG.swiglu_limit
    assert (gate > lim).any() and (gate < -lim).any() and (up > lim).any() and (up < -lim).any()
    wrong = _numpy_moe(p, x, weights, experts, lim, gate_both_sides=True)
    assert np.abs(wrong - ref).max() > 1e-2, "the clamp cases are exercised"


def test_load_hand_case():
    """Router zero → equal scores; the biases alone pick {0, 1} for text and {6, 7} for the image token."""
    p = _params()
    p["router"] = jnp.zeros_like(p["router"])
    p["bias"] = jnp.array([3.0, 2.0, 1.0, 0, 0, 0, 0, 0])
    p["bias_vl"] = jnp.array([0, 0, 0, 0, 0, 0, 2.0, 3.0])
    x, mask = _x((4,)), jnp.array([False, True, False, False])
    weights, experts, _ = _route(CFG, p, x, mask)
    np.testing.assert_array_equal(np.sort(experts, -1), [[0, 1], [6, 7], [0, 1], [0, 1]])
    np.testing.assert_allclose(weights, RSF / 2, rtol=1e-6)
    for dispatch in ("dense", "ragged"):
        _, load = _moe(CFG, p, x, image_mask=mask, dispatch=dispatch)
        np.testing.assert_allclose(load, [3 / 8, 3 / 8, 0, 0, 0, 0, 1 / 8, 1 / 8], rtol=1e-6)
    _, load = _moe(CFG, _params(), _x((3, 5)))
    np.testing.assert_allclose(load.sum(), 1.0, rtol=1e-6)


def test_bias_update_sign_rule():
    bias = jnp.array([0.0, 1.0, -1.0, 0.0])
    load = jnp.array([0.5, 0.25, 0.25, 0.0])  # mean 0.25: expert 0 over-, expert 3 under-loaded
    np.testing.assert_allclose(bias_update(bias, load, 0.1), [-0.1, 1.0, -1.0, 0.1], rtol=1e-6)


def test_grad_both_paths_agree():
    p, x = _params(bias_std=0.3), _x((3, 5))
    r = jax.random.normal(jax.random.key(7), x.shape)

    def loss(params, dispatch):
        return jnp.sum(moe(CFG, params, x, dispatch=dispatch)[0] * r)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g_dense, g_ragged = grad(p, "dense"), grad(p, "ragged")
    for name in ("w1", "w3", "w2", "router"):
        scale = float(jnp.abs(g_dense[name]).max())
        assert scale > 1e-3, name
        # The weight grads sum over tokens in a different order per path: f32 rounding, relative to the largest.
        np.testing.assert_allclose(g_ragged[name], g_dense[name], atol=1e-6 * scale, rtol=1e-5)
    np.testing.assert_allclose(g_ragged["shared"]["w2"], g_dense["shared"]["w2"], atol=1e-6, rtol=0)


def test_bfloat16_compute_close_to_float32():
    cfg = CFG.replace(dtype="bfloat16")
    p, x = _params(), _x((9,))
    ref, _ = _moe(CFG, p, x, dispatch="dense")
    y, _ = _moe(cfg, p, x, dispatch="ragged")
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, ref, atol=3e-2 * float(jnp.abs(ref).max()))


def test_bad_input():
    p, x = _params(), _x((4,))
    with pytest.raises(ValueError, match=r"x.shape=\(4, 32\).*hidden_size=64"):
        moe(CFG, p, x[:, :32])
    with pytest.raises(ValueError, match=r"x.shape"):
        route(CFG, p, x[:, :32])
    with pytest.raises(ValueError, match=r"image_mask.shape=\(5,\).*x.shape\[:-1\]=\(4,\)"):
        moe(CFG, p, x, image_mask=jnp.zeros((5,), bool))
    with pytest.raises(ValueError, match=r"dispatch='sparse'.*'dense', 'ragged'"):
        moe(CFG, p, x, dispatch="sparse")
    with pytest.raises(ValueError, match=r"load.shape=\(4,\).*bias.shape=\(8,\)"):
        bias_update(p["bias"], jnp.ones((4,)), 0.1)
