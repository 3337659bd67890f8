"""Unit tests of csa2.mhc (SPEC §10): coefficient ranges, Sinkhorn, collapse/update, single-pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from csa2 import mhc
from csa2.norm import rms_norm
from csa2.presets import preset

CFG = preset("mini")  # hc_mult 4, hidden 64, float32
N, D = CFG.hc_mult, CFG.hidden_size
coefficients = jax.jit(mhc.coefficients, static_argnums=0)  # one compile per shape, not op by op


def site_params(key):
    """One site's parameters as a plain dict (the `HyperConnection` module's state)."""
    return nnx.to_pure_dict(nnx.state(mhc.HyperConnection(CFG, rngs=nnx.Rngs(key))))


def random_params(key, fn_std=0.03, base_std=0.3):
    """Site params with non-trivial base and scale, so every coefficient depends on X.

    Moderate logits: 20 Sinkhorn iterations then reach 1e-5; sharp comb logits stop short of
    doubly stochastic by design (the reference also stops after hc_sinkhorn_iters)."""
    k_fn, k_base, k_scale = jax.random.split(key, 3)
    params = site_params(k_fn)
    return {"fn": params["fn"] * (fn_std / CFG.initializer_range),
            "base": base_std * jax.random.normal(k_base, params["base"].shape),
            "scale": 1.0 + 0.5 * jax.random.normal(k_scale, (3,))}


def random_streams(key, shape=(2, 3)):
    return jax.random.normal(key, (*shape, N, D), jnp.float32)


def test_init_shapes_and_values():
    module = mhc.HyperConnection(CFG, rngs=nnx.Rngs(0))
    assert {name for name, _ in nnx.to_flat_state(nnx.state(module, nnx.Param))} == {("fn",), ("base",), ("scale",)}
    params = nnx.to_pure_dict(nnx.state(module))
    assert params["fn"].shape == (N * D, (2 + N) * N) and params["fn"].dtype == jnp.float32
    np.testing.assert_array_equal(params["base"], np.zeros((2 + N) * N, np.float32))
    np.testing.assert_array_equal(params["scale"], np.ones(3, np.float32))


def test_coefficient_ranges_and_doubly_stochastic_comb():
    params = random_params(jax.random.PRNGKey(1))
    pre, post, comb = coefficients(CFG, params, random_streams(jax.random.PRNGKey(2)))
    assert pre.shape == (2, 3, N) and post.shape == (2, 3, N) and comb.shape == (2, 3, N, N)
    assert bool(jnp.all(pre > CFG.hc_eps)) and bool(jnp.all(pre < 1 + CFG.hc_eps))
    assert bool(jnp.all(post > 0)) and bool(jnp.all(post < 2))
    assert bool(jnp.all(comb > 0))
    np.testing.assert_allclose(comb.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-5)
    assert float(jnp.std(pre)) > 0.05 and float(jnp.std(comb)) > 0.03  # not a degenerate case


def test_collapse_hand_case():
    X = jnp.array([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]])  # n = 2, d = 3
    np.testing.assert_allclose(mhc.collapse(X, jnp.array([0.5, 0.25])), [3.0, 6.0, 9.0])
    np.testing.assert_array_equal(mhc.collapse(X, mhc.first_pre(2)), X[0])


def test_update_hand_case():
    X = jnp.array([[1.0, 0.0], [0.0, 2.0]])  # n = 2, d = 2
    f_out = jnp.array([4.0, -4.0])
    post = jnp.array([0.5, 1.5])
    comb = jnp.array([[0.75, 0.25], [0.25, 0.75]])  # comb[j, k]: weight of stream j into k
    # X'_0 = 0.5·f + 0.75·X_0 + 0.25·X_1 ; X'_1 = 1.5·f + 0.25·X_0 + 0.75·X_1
    expected = [[2.0 + 0.75, -2.0 + 0.5], [6.0 + 0.25, -6.0 + 1.5]]
    np.testing.assert_allclose(mhc.update(X, f_out, post, comb), expected)
    # comb is used as comb[j, k], not its transpose
    comb = jnp.array([[1.0, 0.0], [1.0, 0.0]])
    np.testing.assert_allclose(mhc.update(X, jnp.zeros(2), jnp.zeros(2), comb), [[1.0, 2.0], [0.0, 0.0]])


def test_update_n4_batched():
    X = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    comb = jnp.broadcast_to(jnp.eye(4)[::-1], (2, 4, 4))  # stream j → stream 3 − j
    out = mhc.update(X, jnp.ones((2, 3)), jnp.full((2, 4), 2.0), comb)
    np.testing.assert_allclose(out, X[:, ::-1] + 2.0)


def test_expand_and_first_pre():
    h = jnp.arange(6.0).reshape(2, 3)
    X = mhc.expand(h, 4)
    assert X.shape == (2, 4, 3)
    for k in range(4):
        np.testing.assert_array_equal(X[:, k], h)
    np.testing.assert_array_equal(mhc.first_pre(4), [1.0, 0.0, 0.0, 0.0])
    assert mhc.first_pre(4).dtype == jnp.float32


def toy_F(y):
    """A stand-in sublayer on RMSNorm(y), nonlinear so a different collapse shows."""
    return jnp.tanh(2.0 * rms_norm(y, None, CFG.rms_norm_eps)) + 0.5


def drive(sites, h, single_pass):
    """Run the sites in order exactly as SPEC §10 states; return (final streams, collapse inputs)."""
    X, carried, inputs = mhc.expand(h, N), mhc.first_pre(N), []
    for params in sites:
        pre, post, comb = coefficients(CFG, params, X)
        y = mhc.collapse(X, carried if single_pass else pre)
        inputs.append(y)
        X = mhc.update(X, toy_F(y), post, comb)
        carried = pre
    return X, carried, inputs


def test_single_pass_collapses_with_previous_sites_pre():
    sites = [random_params(jax.random.PRNGKey(i)) for i in (10, 11)]
    h = jax.random.normal(jax.random.PRNGKey(12), (3, D))
    X0 = mhc.expand(h, N)
    pre0, post0, comb0 = coefficients(CFG, sites[0], X0)
    # single-pass by hand: site 0 sees stream 0 (the embedding), site 1 collapses with site 0's pre
    X1 = mhc.update(X0, toy_F(h), post0, comb0)
    pre1, post1, comb1 = coefficients(CFG, sites[1], X1)
    X2 = mhc.update(X1, toy_F(mhc.collapse(X1, pre0)), post1, comb1)
    final = mhc.collapse(X2, pre1)  # the LM head's input uses the last site's pre

    X_sp, last_pre, inputs = drive(sites, h, single_pass=True)
    np.testing.assert_allclose(inputs[0], h, rtol=1e-6)
    np.testing.assert_allclose(X_sp, X2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mhc.collapse(X_sp, last_pre), final, rtol=1e-6, atol=1e-6)

    X_std, _, std_inputs = drive(sites, h, single_pass=False)
    np.testing.assert_allclose(std_inputs[1], mhc.collapse(X1, pre1), rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(std_inputs[0] - inputs[0]))) > 1e-2
    assert float(jnp.max(jnp.abs(std_inputs[1] - inputs[1]))) > 1e-2
    # at site 0 the collapses differ only by a scale (identical streams), which F's RMSNorm removes;
    # the streams part at site 1
    assert float(jnp.max(jnp.abs(X_std - X_sp))) > 1e-3


def test_single_pass_equals_standard_when_previous_pre_equals_own():
    # pre independent of X (its fn columns zero) and the same at both sites, summing to 1, so the
    # one-hot embedding collapse also equals the standard one (the embedding streams are identical).
    def constant_pre(params, target):
        fn = params["fn"].at[:, :N].set(0.0)
        base = params["base"].at[:N].set(jnp.log(target / (1.0 - target)))
        return {**params, "fn": fn, "base": base}

    quarter = jnp.full((N,), 1.0 / N - CFG.hc_eps)
    sites = [constant_pre(random_params(jax.random.PRNGKey(i)), quarter) for i in (20, 21)]
    h = jax.random.normal(jax.random.PRNGKey(22), (3, D))
    X_sp, _, _ = drive(sites, h, single_pass=True)
    X_std, _, _ = drive(sites, h, single_pass=False)
    np.testing.assert_allclose(X_sp, X_std, rtol=1e-5, atol=1e-5)

    # the same sites with a different pre at site 1: single-pass and standard part at site 1
    other = jnp.array([0.7, 0.1, 0.1, 0.1 - CFG.hc_eps])
    sites[1] = constant_pre(sites[1], other)
    X_sp, _, sp_inputs = drive(sites, h, single_pass=True)
    X_std, _, std_inputs = drive(sites, h, single_pass=False)
    np.testing.assert_allclose(sp_inputs[0], std_inputs[0], rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(X_sp - X_std))) > 1e-3


def test_coefficients_float32_for_bfloat16_streams():
    params = random_params(jax.random.PRNGKey(3))
    X = random_streams(jax.random.PRNGKey(4)).astype(jnp.bfloat16)
    pre, post, comb = coefficients(CFG, params, X)
    assert pre.dtype == post.dtype == comb.dtype == jnp.float32
    ref = coefficients(CFG, params, X.astype(jnp.float32))
    for got, want in zip((pre, post, comb), ref):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # the cast is exact
    assert mhc.collapse(X, pre).dtype == jnp.bfloat16
    assert mhc.update(X, X[..., 0, :], post, comb).dtype == jnp.bfloat16


def test_jit_matches_eager():
    params = random_params(jax.random.PRNGKey(5))
    X = random_streams(jax.random.PRNGKey(6))

    @jax.jit
    def site(params, X):
        pre, post, comb = mhc.coefficients(CFG, params, X)
        return mhc.update(X, toy_F(mhc.collapse(X, pre)), post, comb)

    pre, post, comb = mhc.coefficients(CFG, params, X)
    eager = mhc.update(X, toy_F(mhc.collapse(X, pre)), post, comb)
    np.testing.assert_allclose(site(params, X), eager, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(coefficients(CFG, params, X)[2], comb, rtol=1e-6, atol=1e-6)


def test_bad_shapes_raise():
    params = site_params(jax.random.PRNGKey(7))
    X = jnp.zeros((2, N, D))
    with pytest.raises(ValueError, match="X.shape"):
        mhc.coefficients(CFG, params, jnp.zeros((2, N + 1, D)))
    with pytest.raises(ValueError, match="X.shape"):
        mhc.coefficients(CFG, params, jnp.zeros((2, N, D + 1)))
    with pytest.raises(ValueError, match="X.shape"):
        mhc.collapse(jnp.zeros((D,)), jnp.ones(N))
    with pytest.raises(ValueError, match="pre.shape"):
        mhc.collapse(X, jnp.ones(N + 1))
    with pytest.raises(ValueError, match="post.shape"):
        mhc.update(X, jnp.zeros((2, D)), jnp.ones((2, N - 1)), jnp.ones((2, N, N)))
    with pytest.raises(ValueError, match="comb.shape"):
        mhc.update(X, jnp.zeros((2, D)), jnp.ones((2, N)), jnp.ones((2, N)))
    with pytest.raises(ValueError, match="f_out.shape"):
        mhc.update(X, jnp.zeros((2, D + 1)), jnp.ones((2, N)), jnp.ones((2, N, N)))
    with pytest.raises(ValueError, match="n=0"):
        mhc.expand(jnp.zeros((D,)), 0)
    with pytest.raises(ValueError, match="n=0"):
        mhc.first_pre(0)
