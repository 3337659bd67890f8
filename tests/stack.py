"""A residual stack of attention sublayers only (no MoE/mHC): drives CSA2 state transitions in tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from csa2.attention import Chunk, attention, empty_bus, init_attention_params
from csa2.compressor import compress
from csa2.layout import layer_plan
from csa2.norm import rms_norm


def init_stack(cfg, key):
    keys = jax.random.split(key, cfg.num_hidden_layers)
    return [init_attention_params(cfg, spec, k) for spec, k in zip(layer_plan(cfg), keys)]


def stack_step(cfg, params, state, h, start, n_valid, floor=None, *, quantize=True):
    """h [B, S, d] → (outputs of every layer [L, B, S, d], new state). h_{l+1} = h_l + attn(norm(h_l))."""
    b, s, _ = h.shape
    chunk = Chunk(start=start, n_valid=n_valid, floor=jnp.zeros_like(start) if floor is None else floor)
    bus = empty_bus(cfg, b, s)
    gkv, tails = list(state.global_kv), list(state.tails)
    ring_kv, ring_scale = state.swa.kv, state.swa.scale
    outs = []
    for spec, p in zip(layer_plan(cfg), params):
        i = spec.index
        g = cfg.kv_source_layer_ids.index(spec.kv_source) if spec.kv_source is not None else None
        ring = (ring_kv[i], None if ring_scale is None else ring_scale[i])
        x = rms_norm(h, None, cfg.rms_norm_eps)
        if spec.role == "full":
            gkv[g], tails[g] = compress(cfg, p["compressor"], spec.ratio, gkv[g], tails[g], x, start, n_valid,
                                        quantize=quantize)
        out, ring, bus, _ = attention(cfg, spec, p, x, chunk, ring, gkv[g] if g is not None else None, bus,
                                   quantize=quantize)
        ring_kv = ring_kv.at[i].set(ring[0])
        if ring_scale is not None:
            ring_scale = ring_scale.at[i].set(ring[1])
        h = h + out
        outs.append(out)
    state = state.replace(length=start + n_valid, global_kv=tuple(gkv), tails=tuple(tails),
                          swa=state.swa.replace(kv=ring_kv, scale=ring_scale))
    return jnp.stack(outs), state


run_stack = jax.jit(stack_step, static_argnames=("cfg", "quantize"))
