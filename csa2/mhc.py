"""Manifold-constrained hyper-connections (mHC, SPEC §10): `n = hc_mult` residual streams per token.

Each site (attention, FFN) projects its input streams X [n, d] once into three coefficient sets,
all float32 in every mode (DESIGN §6):
- `pre` [n] collapses streams into the sublayer input `y = Σ_k pre_k X_k`;
- `post` [n] places the sublayer output into the streams; `comb` [n, n] (doubly stochastic,
  Sinkhorn) mixes the residual: `X'_k = post_k · F(RMSNorm(y)) + Σ_j comb[j, k] · X_j`.

Standard vs single-pass (SPEC §10). Both compute a site's `post`/`comb` from that site's input
streams and update those same streams; they differ only in which `pre` collapses the input:
- standard mHC: `y = collapse(X, pre)` with the `pre` this site computes from X;
- single-pass (V4.1, `cfg.mhc_single_pass`): `y = collapse(X, pre_prev)` with the `pre` of the
  previous site (computed from the previous site's input streams, before its update); this site's
  `pre` is handed on to the next site. The first site of the model gets `first_pre(n)` = one-hot
  [1, 0, …, 0] (stream 0 = the embedding); the final collapse before the LM norm/head uses the
  last site's `pre` — there are no head parameters.
In transformers' V4.1 (`DeepseekV41DecoderLayer.forward`): `hc_mixes` runs on the site's input
streams (after Engram at the attention site), the attention collapses with the incoming `pre_mix`,
the FFN with `attn_pre`, the layer returns `ffn_pre`; `DeepseekV41TextModel.forward` starts from a
float32 one-hot `pre_mix` and ends with `hc_collapse(hidden_states, pre_mix)` then `norm`.

Parameters of one site mirror transformers' `fn`/`base`/`scale`, with `fn` stored as
[n·d, (2+n)·n] (fan_in, fan_out; transformers' `fn` transposed). The flattened stream is
stream-major (stream k occupies channels k·d … k·d+d−1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from csa2.checks import is_static_int
from csa2.config import ModelConfig
from csa2.norm import rms_norm
from csa2.params import normal, ones, zeros

Array = jax.Array
_HIGHEST = jax.lax.Precision.HIGHEST


class HyperConnection(nnx.Module):
    """One mHC site's float32 weights (SPEC §10): `fn` N(0, initializer_range²), `base` zeros, `scale` ones."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        n, d = cfg.hc_mult, cfg.hidden_size
        width = (2 + n) * n
        self.fn = normal(rngs, (n * d, width), cfg.initializer_range, ("hc_in", "hc_mix"))
        self.base = zeros((width,), ("hc_mix",))
        self.scale = ones((3,), ("hc_scales",))


def coefficients(cfg: ModelConfig, params: dict, X: Array) -> tuple[Array, Array, Array]:
    """`(pre [..., n], post [..., n], comb [..., n, n])` of the streams X [..., n, d], float32 (SPEC §10)."""
    n, d = cfg.hc_mult, cfg.hidden_size
    if X.ndim < 2 or X.shape[-2:] != (n, d):
        raise ValueError(f"X.shape={X.shape}: expected [..., {n}, {d}] (hc_mult streams of hidden_size)")
    flat = X.astype(jnp.float32).reshape(*X.shape[:-2], n * d)
    # (W_hc·flat)·rsqrt(mean(flat²)+eps) of SPEC §10, normalized first as transformers does (linear ⇒ equal).
    with jax.named_scope("fp32_mhc"):
        mixes = jnp.matmul(rms_norm(flat, None, cfg.rms_norm_eps), params["fn"].astype(jnp.float32),
                           precision=_HIGHEST)
    base, scale = params["base"].astype(jnp.float32), params["scale"].astype(jnp.float32)
    eps = cfg.hc_eps
    pre = jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + eps
    post = 2.0 * jax.nn.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = (mixes[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*mixes.shape[:-1], n, n)
    # The row softmax is Sinkhorn's first row step: then one column step and (iters − 1) row/column pairs.
    comb = _normalize(jax.nn.softmax(logits, axis=-1) + eps, axis=-2, eps=eps)
    # The loop runs on [n, n, ...] (tokens last): each half-step then adds n whole slices over every token at
    # once, where sums over a trailing axis of n = 4 would not vectorize (7× slower on CPU at 2048 tokens).
    comb = jnp.moveaxis(comb, (-2, -1), (0, 1))

    def row_col(_, c):
        return _normalize(_normalize(c, axis=1, eps=eps), axis=0, eps=eps)

    comb = jax.lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, row_col, comb)
    return pre, post, jnp.moveaxis(comb, (0, 1), (-2, -1))


def _normalize(c: Array, axis: int, eps: float) -> Array:
    """Divide by the sum along `axis` plus `eps` (one Sinkhorn half-step, SPEC §10)."""
    return c / (jnp.sum(c, axis=axis, keepdims=True) + eps)


def collapse(X: Array, pre: Array) -> Array:
    """`y = Σ_k pre_k X_k` [..., d], weighted in float32 and returned in X's dtype (SPEC §10)."""
    _check_streams(X, "pre", pre, 1)
    y = jnp.sum(pre.astype(jnp.float32)[..., None] * X.astype(jnp.float32), axis=-2)
    return y.astype(X.dtype)


def update(X: Array, f_out: Array, post: Array, comb: Array) -> Array:
    """`X'_k = post_k · f_out + Σ_j comb[j, k] · X_j` [..., n, d], in float32, returned in X's dtype (SPEC §10)."""
    _check_streams(X, "post", post, 1)
    _check_streams(X, "comb", comb, 2)
    if f_out.shape[-1:] != X.shape[-1:]:
        raise ValueError(f"f_out.shape={f_out.shape}: expected [..., {X.shape[-1]}] (the d of X.shape={X.shape})")
    # n ordered multiply-adds rather than a [n, n]·[n, d] dot per token, which XLA:CPU runs as a batched matmul
    # call: they fuse with the site's other element-wise work (docs/results.md, "The mHC stream mix"). Like any
    # op, they round alike across batch sizes only to float rounding (`csa2.state`, "What is bitwise").
    c, x = comb.astype(jnp.float32), X.astype(jnp.float32)
    with jax.named_scope("fp32_mhc"):
        mixed = sum(c[..., j, :, None] * x[..., j, None, :] for j in range(X.shape[-2]))
    out = post.astype(jnp.float32)[..., None] * f_out.astype(jnp.float32)[..., None, :] + mixed
    return out.astype(X.dtype)


def expand(h: Array, n: int) -> Array:
    """The embedding h [..., d] as `n` identical streams [..., n, d] (SPEC §10)."""
    _check_n(n)
    return jnp.broadcast_to(h[..., None, :], (*h.shape[:-1], n, h.shape[-1]))


def first_pre(n: int) -> Array:
    """The one-hot [1, 0, …, 0] float32 `pre` that collapses the embedding streams in single-pass mHC (SPEC §10)."""
    _check_n(n)
    return jnp.zeros((n,), jnp.float32).at[0].set(1.0)


def _check_n(n: int) -> None:
    """Raise ValueError unless the stream count `n` is a positive integer (DESIGN §7)."""
    if not is_static_int(n) or n < 1:
        raise ValueError(f"n={n!r}: the stream count (hc_mult) must be a positive integer")


def _check_streams(X: Array, name: str, coef: Array, axes: int) -> None:
    """Raise ValueError unless X is [..., n, d] and `coef` ends in `axes` axes of size n (DESIGN §7)."""
    if X.ndim < 2:
        raise ValueError(f"X.shape={X.shape}: expected [..., n, d] (n residual streams of width d)")
    n = X.shape[-2]
    if coef.shape[-axes:] != (n,) * axes:
        raise ValueError(f"{name}.shape={coef.shape}: expected [...{', n' * axes}] with n = {n}, "
                         f"the stream count of X.shape={X.shape}")
