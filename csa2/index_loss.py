"""The indexer's training objective (SPEC §13): KL from the main attention to the indexer.

The LM loss gives the indexer no gradient through top-k, so each index source learns with the
DSA auxiliary loss: per query, the target `p` is the main attention probability mass of each
Global entry in the indexer's set, summed over heads and L1-normalized, and the loss is
`KL(p ‖ softmax(score))` over the same set. `p` (`hooks.Sight.probs`) is a constant
(stop-gradient), and the indexer's inputs are detached from the main graph by the callers
(`attention`, `compressor`), so this loss trains the indexer weights only.

Sets: "sparse" = the entries the indexer selected (top-k); "dense" = every visible entry (the
warm-up recipe, before sparse training). `IndexLoss` is the instrument that taps it on every index source
(`forward(..., instrument=IndexLoss(mode))`: `aux["tap"]` is the loss per layer `[L]`, 0 on the others).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from csa2.config import ModelConfig
from csa2.hooks import Instrument, Sight
from pallas_kernels import ops

Array = jax.Array
MODES = ("sparse", "dense")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IndexLoss(Instrument):
    """Taps the SPEC §13 indexer loss of every index source (Full and Reindex layers): a scalar per layer, 0 on
    the other layers. Every layer reads its own top-k."""

    mode: str = dataclasses.field(default="sparse", metadata=dict(static=True))

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"IndexLoss.mode={self.mode!r}: use one of {MODES}")

    def tap(self, cfg: ModelConfig, sight: Sight, read: Array) -> Array:
        if sight.q_index is None:
            return jnp.zeros((), jnp.float32)
        source, count = sight.source, sight.visible()  # [B, S]
        if self.mode == "sparse":
            ids = sight.bus.topk  # [B, S, K]: what this layer's indexer selected
            valid = ids >= 0
            scores = ops.indexer_scores_gathered(sight.q_index, sight.w_index, source.ikey, source.rows(ids),
                                                 count + source.offset, impl=cfg.kernel_impl)
        else:
            ids, valid = sight.dense_ids()  # [B, S, N]
            scores = ops.indexer_scores(sight.q_index, sight.w_index, source.ikeys(), count, impl=cfg.kernel_impl)
        _, probs = sight.probs(ids, valid)
        return indexer_kl(probs, scores, valid, sight.valid)


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
