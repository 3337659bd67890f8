"""A residual stack of attention sublayers only (no MoE/mHC): drives CSA2 state transitions in tests.

It reads and writes the state the way `csa2.stack` does: a layer's SWA ring is row `i` of
`state.swa [B, L, slots, ·]`, a KV source is `(stack, slot)` of `layout.kv_address` inside its
stacked Global KV and tails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from csa2.attention import Attention, attention
from csa2.chunk import Chunk
from csa2.compressor import compress
from csa2.indexer import Bus
from csa2.layout import kv_address, layer_plan
from csa2.norm import rms_norm


def init_stack(cfg, key):
    """Plain parameter dicts of every layer's attention sublayer."""
    keys = jax.random.split(key, cfg.num_hidden_layers)
    return [nnx.to_pure_dict(nnx.state(Attention(cfg, spec, rngs=nnx.Rngs(k))))
            for spec, k in zip(layer_plan(cfg), keys)]


def stack_step(cfg, params, state, h, start, n_valid, floor=None, *, quantize=True):
    """h [B, S, d] → (outputs of every layer [L, B, S, d], new state). h_{l+1} = h_l + attn(norm(h_l))."""
    b, s, _ = h.shape
    chunk = Chunk(start=start, n_valid=n_valid, floor=jnp.zeros_like(start) if floor is None else floor)
    bus = Bus.empty(cfg, b, s)
    gkv, tails, swa = list(state.global_kv), list(state.tails), state.swa
    outs = []
    for spec, p in zip(layer_plan(cfg), params):
        i = spec.index
        ring = jax.tree.map(lambda a: a[:, i], swa)
        x = rms_norm(h, None, cfg.rms_norm_eps)
        source = None
        if spec.kv_source is not None:
            k, slot = kv_address(cfg, spec.kv_source)
            source = gkv[k].source(slot)
            if spec.role == "full":
                tail = jax.tree.map(lambda a: a[:, slot], tails[k])
                source, tail = compress(cfg, p["compressor"], spec.ratio, source, tail, x, start, n_valid,
                                        quantize=quantize)
                gkv[k] = source.stack()
                tails[k] = jax.tree.map(lambda a, t: a.at[:, slot].set(t), tails[k], tail)
        out, ring, bus, _, _ = attention(cfg, spec, p, x, chunk, ring, source, bus, quantize=quantize)
        swa = jax.tree.map(lambda a, r: a.at[:, i].set(r), swa, ring)
        h = h + out
        outs.append(out)
    state = state.replace(length=start + n_valid, global_kv=tuple(gkv), tails=tuple(tails), swa=swa)
    return jnp.stack(outs), state


run_stack = jax.jit(stack_step, static_argnames=("cfg", "quantize"))
