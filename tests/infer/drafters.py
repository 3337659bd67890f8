"""Drafters with a known behaviour for tests of speculative decoding on random weights."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from csa2 import model


def echo_markov(params, tokens, rank: int):
    """`params` with a Markov head that echoes the previous token for the first `rank` of `tokens` (sorted ids):
    W1 one-hot into rank slots, W2 = 50 × one-hot back, so a drafter on random weights proposes "the same token
    again" strongly, and accepted runs, rejections and bonus tokens all occur against a random target."""
    echo = sorted(set(np.asarray(tokens).ravel().tolist()))[:rank]
    pure = nnx.to_pure_dict(params)
    w1 = np.zeros(pure[model.DRAFTER]["markov_embed"].shape, np.float32)
    w2 = np.zeros(pure[model.DRAFTER]["markov_head"].shape, np.float32)
    for i, t in enumerate(echo):
        w1[t, i], w2[i, t] = 1.0, 50.0
    pure[model.DRAFTER]["markov_embed"], pure[model.DRAFTER]["markov_head"] = jnp.asarray(w1), jnp.asarray(w2)
    out = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(out, pure)
    return out
