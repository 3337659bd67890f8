"""How a token is drawn from logits, inside jit: greedy, or the tempered top-p nucleus (DESIGN §7).

`sample` draws; `distribution` is the distribution it draws from, which speculative acceptance
(SPEC §12) compares between drafter and target. Temperature and top-p are traced values, so no
setting recompiles; temperature 0 means greedy (the distribution is one-hot on the argmax).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def nucleus(logits: Array, top_p: Array) -> Array:
    """Mask [..., V] logits outside the top-p nucleus to −inf: the smallest set of most likely tokens
    whose probability reaches `top_p` (sort, cumulate, cut). The top token is always kept; tokens tied
    with the cut-off logit are kept too. Sampling the masked logits renormalizes over the nucleus."""
    ranked = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)  # descending
    probs = jax.nn.softmax(ranked, axis=-1)
    above = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked before each one
    cutoff = jnp.min(jnp.where(above < top_p, ranked, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def sample(logits: Array, key: Array, temperature: Array, top_p: Array) -> Array:
    """One token per row [...] int32 from logits [..., V]: argmax when `temperature` is 0, else a draw from
    the tempered nucleus. A runtime `lax.cond`, so greedy skips the sort and no setting recompiles."""
    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn(_):
        scaled = logits.astype(jnp.float32) / temperature
        return jax.random.categorical(key, nucleus(scaled, top_p), axis=-1).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, drawn, greedy, None)


def distribution(logits: Array, temperature: Array, top_p: Array) -> Array:
    """The probabilities [..., V] float32 that `sample` draws from: the tempered nucleus softmax, or the
    one-hot argmax when `temperature` is 0."""
    def greedy(_):
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

    def drawn(_):
        return jax.nn.softmax(nucleus(logits.astype(jnp.float32) / temperature, top_p), axis=-1)

    return jax.lax.cond(temperature > 0, drawn, greedy, None)
