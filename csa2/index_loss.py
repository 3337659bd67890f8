"""The indexer's training objective (SPEC §13): KL from the main attention to the indexer.

The LM loss gives the indexer no gradient through top-k, so each index source learns with the
DSA auxiliary loss: per query, the target `p` is the main attention probability mass of each
Global entry in the indexer's set, summed over heads and L1-normalized, and the loss is
`KL(p ‖ softmax(score))` over the same set. `p` (from `probe.attention_probs`) is a constant
(stop-gradient), and the indexer's inputs are detached from the main graph by the callers
(`attention`, `compressor`), so this loss trains the indexer weights only.

Sets: "sparse" = the entries the indexer selected (top-k); "dense" = every visible entry (the
warm-up recipe, before sparse training).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
MODES = ("sparse", "dense")


def indexer_kl(main_probs: Array, scores: Array, valid: Array, query_valid: Array) -> Array:
    """Mean over queries of `KL(p ‖ softmax(scores))` on the valid entries of each query's set.

    main_probs [B, S, H, E] (the set's columns only), scores [B, S, E] indexer logits,
    valid [B, S, E], query_valid [B, S]. Queries with an empty set do not count.
    """
    mass = jax.lax.stop_gradient(jnp.sum(jnp.where(valid[:, :, None], main_probs, 0.0), axis=2))  # [B, S, E]
    total = jnp.sum(mass, axis=-1, keepdims=True)
    p = mass / jnp.maximum(total, 1e-30)
    log_q = jax.nn.log_softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
    terms = jnp.where(valid & (p > 0), p * (jnp.log(jnp.maximum(p, 1e-30)) - log_q), 0.0)
    counted = query_valid & jnp.any(valid, axis=-1) & (total[..., 0] > 0)
    return jnp.sum(jnp.where(counted, jnp.sum(terms, axis=-1), 0.0)) / jnp.maximum(jnp.sum(counted), 1)
