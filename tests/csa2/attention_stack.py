"""A residual stack of attention sublayers only (no MoE/mHC): drives CSA2 state transitions in tests.

Each layer is the real sublayer on the real state: `csa2.stack.layer_kv` hands it its view of the state (ring,
Global KV source, compressor tail), `csa2.attention.attention` returns it updated, and `csa2.stack.put_layer_kv`
writes it back, as `csa2.stack.layer` does. Only the mHC and MoE around it are left out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from csa2.attention import Attention, attention
from csa2.chunk import Chunk
from csa2.context import Context
from csa2.hooks import OWN_TOPK
from csa2.indexer import Bus
from csa2.layout import kv_address, layer_plan
from csa2.norm import rms_norm
from csa2.stack import largest_source, layer_kv, put_layer_kv


def init_stack(cfg, key):
    """Plain parameter dicts of every layer's attention sublayer."""
    keys = jax.random.split(key, cfg.num_hidden_layers)
    return [nnx.to_pure_dict(nnx.state(Attention(cfg, spec, rngs=nnx.Rngs(k))))
            for spec, k in zip(layer_plan(cfg), keys)]


def context(state, start, n_valid, floor=None, *, quantize=True, instrument=OWN_TOPK):
    """The `Context` of a chunk at `start` with `n_valid` real rows (no Engram, every row, any write), every
    layer's window floored at `floor` (default 0)."""
    chunk = Chunk(start=start, n_valid=n_valid, floor=jnp.zeros_like(start) if floor is None else floor)
    return Context(chunk=chunk, history=None, rows=None, written_from=None, quantize=quantize,
                   instrument=instrument, entries=largest_source(state), split=0, decoder_floor=chunk.floor)


def stack_step(cfg, params, state, h, start, n_valid, floor=None, *, quantize=True):
    """h [B, S, d] → (outputs of every layer [L, B, S, d], new state). h_{l+1} = h_l + attn(norm(h_l))."""
    b, s, _ = h.shape
    ctx = context(state, start, n_valid, floor, quantize=quantize)
    bus = Bus.empty(cfg, b, s)
    outs = []
    for spec, p in zip(layer_plan(cfg), params):
        slot = None if spec.kv_source is None else jnp.int32(kv_address(cfg, spec.kv_source)[1])
        x = rms_norm(h, None, cfg.rms_norm_eps)
        index = jnp.int32(spec.index)
        out, kv, bus, _ = attention(cfg, spec, p, x, layer_kv(cfg, spec, state, index, slot), bus, ctx, index)
        state = put_layer_kv(cfg, spec, state, index, slot, kv)
        h = h + out
        outs.append(out)
    return jnp.stack(outs), state.replace(length=start + n_valid)


run_stack = jax.jit(stack_step, static_argnames=("cfg", "quantize"))
