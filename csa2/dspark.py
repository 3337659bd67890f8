"""DSpark: the parallel drafter of SPEC §12, its context windows and its heads.

Context: the per-token mean over mHC streams of the attention-site inputs of `dspark_target_layer_ids`
(collected by `csa2.stack`) → concat → `main_proj` → `main_norm`. Each draft stage keeps its own
window of that context (the stage's `wkv`, `kv_norm`, plain RoPE θ, FP8 like the backbone rings) in
`State.draft`. Every model call writes the windows for the rows whose features it computed, keyed by
position like the rest of the state, so a rejected draft is scratch and commit is still "set length".

Block: tokens `[C, noise × (γ−1)]` at positions `L … L + γ − 1`: C is the freshly sampled token, rotated
at its own position L = `length` (not yet in the cache), so slot 0 sits one step after the last context
entry — the references' `anchor_pos` is L − 1 and their block starts at `anchor_pos + 1`, the same
positions, on which a released drafter was trained. Each slot attends to the context window
`[L − W, L − 1]` (never below the replay floor, whose rows have no features) and to every slot of its
own block (bidirectional), with the sink in the denominator; slot k's output gives the base logits
`U_k` of the token at position `L + 1 + k`. A stage is one single-pass mHC block: SWA attention, then
MoE with the draft expert counts.

Heads: Markov `logits_k = U_k + W2·W1[x_{k−1}]` (x_{−1} = anchor), sampled left to right; confidence
`c_k = σ(w·[h_k ; W1[x_{k−1}]])` with h_k the collapsed pre-norm hidden state.

The context is strictly before C, in training as at inference: C is sampled, not yet run through the
target, so its own features do not exist when the drafter runs. (NeMo Automodel's "anchor" is the last
processed position L − 1, so its training mask shows each block the same window.)

Context under bounded replay (SPEC §11). The target layers lie in the decoder, so a prefill with replay window R
writes context only for its decoder tail, and `window_rows` masks the positions below `State.floor`. With R < W,
`model.prefill` then `model.draft` gives the first drafts R context rows instead of W, until the decoded positions
fill the window above the floor. `infer.speculative` avoids this: it prefills with `csa2.replay.drafting_replay`
(R raised to W; see there for chunks and prefix hits). With R ≥ W no row is masked, but the oldest are
approximate: target layer ℓ computes position p with decoder windows cut at the floor unless
p ≥ floor + (ℓ − split)·(W − 1), so the context equals exact mode's only from R ≥ W + (max target − split)·(W − 1)
(61 for mini, 125 for demo, 2541 for the release; `tests/csa2/test_dspark.py`). Measured on the `make demo`
checkpoint (W = 32, γ = 5, greedy, 95 % intervals over held-out 128-token prompts), the loss is small against
the demo drafter's noise: decoding 64 tokens after a prefill with R = 8 / 16 as given, the mean acceptance length
is 1.59 [1.46, 1.77] / 1.60 [1.47, 1.79] against exact prefill's 1.56 [1.45, 1.72] (n = 32; paired differences
+0.03 [−0.03, 0.13] / +0.04 [−0.01, 0.14], the target's own tokens change too); the first step after an exact
prefill, with the drafter alone limited to the last 8 / 16 of its 32 context rows, loses 0.06 [−0.19, 0.03] /
0.09 [−0.20, 0.00] of its 1.61 [1.41, 1.82] (n = 128).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from csa2 import cache, mhc
from csa2.attention import Attention, layer_frequencies, output, queries, window_kv
from csa2.config import ModelConfig
from csa2.layout import LayerSpec
from csa2.moe import MoE, moe
from csa2.norm import rms_norm
from csa2.params import linear, normal, ones
from csa2.sampling import sample
from csa2.stack import site_input
from pallas_kernels import ops
from pallas_kernels.formats import MAIN, WINDOW
from pallas_kernels.stored import NO_ENTRY, Stored, concat_rows

Array = jax.Array

DRAFTER = "drafter"  # the drafter's subtree of the model's parameters (`csa2.model.Model.drafter`)


def draft_moe_config(cfg: ModelConfig) -> ModelConfig:
    """The MoE shape of a draft stage: the draft expert counts (SPEC §12), the rest as the backbone."""
    return cfg.replace(n_routed_experts=cfg.dspark_n_routed_experts,
                       num_experts_per_tok=cfg.dspark_num_experts_per_tok)


def stage_spec(cfg: ModelConfig, stage: int) -> LayerSpec:
    """A draft stage's attention is SWA-only (ratio 0): no compressor, no indexer."""
    return LayerSpec(index=cfg.num_hidden_layers + stage, role="swa", ratio=0, kv_source=None, index_source=None,
                     is_encoder=False, has_engram=False, uses_candidates=False, is_candidate_source=False)


class DraftStage(nnx.Module):
    """One draft block's parameters: two mHC sites with their norms, SWA attention, the draft MoE."""

    def __init__(self, cfg: ModelConfig, stage: int, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.attn_hc = mhc.HyperConnection(cfg, rngs)
        self.attn_norm = ones((d,), ("embed",))
        self.attn = Attention(cfg, stage_spec(cfg, stage), rngs)
        self.ffn_hc = mhc.HyperConnection(cfg, rngs)
        self.ffn_norm = ones((d,), ("embed",))
        self.moe = MoE(draft_moe_config(cfg), rngs)


class Drafter(nnx.Module):
    """Every DSpark parameter (SPEC §12): the context projection, `num_nextn_predict_layers` stages, the final
    norm, the Markov head (W1 `[V, r]`, W2 `[r, V]`) and the confidence head `w [d + r]`. The embedding and
    LM head are the backbone's."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, r, v, std = cfg.hidden_size, cfg.dspark_markov_rank, cfg.vocab_size, cfg.initializer_range
        n_t = len(cfg.dspark_target_layer_ids)
        self.main_proj = normal(rngs, (n_t * d, d), std, ("draft_features", "embed"), compute=True)
        self.main_norm = ones((d,), ("embed",))
        self.stages = nnx.List([DraftStage(cfg, i, rngs) for i in range(cfg.num_nextn_predict_layers)])
        self.norm = ones((d,), ("embed",))
        self.markov_embed = normal(rngs, (v, r), std, ("vocab", "markov"))
        self.markov_head = normal(rngs, (r, v), std, ("markov", "vocab"), compute=True)
        self.confidence = normal(rngs, (d + r,), std, ("draft_confidence",))


# ---------------------------------------------------------------------------------------------
# Context windows

def context(cfg: ModelConfig, p: dict, features: Array) -> Array:
    """Target features [B, T, n_t, d] → the drafter's context [B, T, d]: concat, `main_proj`, `main_norm`."""
    b, t, n_t, d = features.shape
    return rms_norm(linear(features.reshape(b, t, n_t * d), p["main_proj"], cfg.dtype), p["main_norm"],
                    cfg.rms_norm_eps)


def _stage(ring: Stored, i: int) -> Stored:
    return jax.tree.map(lambda a: a[:, i], ring)


def write_context(cfg: ModelConfig, p: dict, windows: Stored, features: Array, positions: Array, valid: Array,
                  new_length: Array, quantize: bool) -> Stored:
    """`windows [B, stages, slots, ·]` (`State.draft`) with the context of rows `features [B, T, n_t, d]` at
    `positions [B, T]` (written where `valid`, the newest `slots` before `new_length [B]`) in every stage."""
    ctx = context(cfg, p, features)
    slot, keep = cache.ring_slots(positions, valid, new_length, windows.rows)
    freqs = layer_frequencies(cfg, 0)
    rings = []
    for i in range(cfg.num_nextn_predict_layers):
        ring = _stage(windows, i)
        kv = cache.encode(window_kv(cfg, p["stages"][i]["attn"], ctx, positions, freqs), ring, quantize)
        rings.append(ring.write(slot, kv, keep))
    return jax.tree.map(lambda *a: jnp.stack(a, axis=1), *rings)


# ---------------------------------------------------------------------------------------------
# The draft stages

def _attend(cfg: ModelConfig, p: dict, x: Array, positions: Array, ctx: Stored, ctx_idx: Array,
            quantize: bool) -> Array:
    """A stage's attention: queries x [B, Q, d] (Q = blocks × γ) see rows `ctx_idx [B, Q, C]` of `ctx`
    (−1 = none) and every slot of their own block, in one sink softmax (SPEC §3, §12)."""
    b, q_len, _ = x.shape
    gamma = cfg.dspark_block_size
    freqs = layer_frequencies(cfg, 0)
    _, q = queries(cfg, p, x, positions, freqs)
    own = cache.encode(window_kv(cfg, p, x, positions, freqs), ctx, quantize)  # [B, Q, ·]
    slots = jnp.arange(q_len, dtype=jnp.int32)
    block = (slots // gamma * gamma)[:, None] + jnp.arange(gamma, dtype=jnp.int32)[None]  # [Q, γ]
    idx = jnp.concatenate([ctx_idx, jnp.broadcast_to(ctx.rows + block, (b, q_len, gamma))], axis=-1)
    main = Stored.empty((b, 0), cfg.head_dim, MAIN, ctx.packed)
    o = ops.sparse_attention(q, p["sink"], main, jnp.zeros((b, q_len, 0), jnp.int32), concat_rows(ctx, own), idx,
                             impl=cfg.kernel_impl)
    return output(cfg, p, o, positions, freqs)


def hidden(cfg: ModelConfig, p: dict, embed: Array, block: Array, positions: Array, contexts: list[Stored],
           ctx_idx: Array, quantize: bool) -> Array:
    """Every draft stage on block tokens `block [B, Q]` at `positions [B, Q]`, stage i reading `contexts[i]`
    at `ctx_idx [B, Q, C]`: the collapsed pre-norm hidden states h [B, Q, d] (single-pass mHC, SPEC §10)."""
    b, q_len = block.shape
    dm = draft_moe_config(cfg)
    X = mhc.expand(embed[block], cfg.hc_mult)
    pre = jnp.broadcast_to(mhc.first_pre(cfg.hc_mult), (b, q_len, cfg.hc_mult))
    for i, ctx in enumerate(contexts):
        s = p["stages"][i]
        x, attn_pre, post, comb = site_input(cfg, s["attn_hc"], s["attn_norm"], X, pre)
        X = mhc.update(X, _attend(cfg, s["attn"], x, positions, ctx, ctx_idx, quantize), post, comb)
        x, pre, post, comb = site_input(cfg, s["ffn_hc"], s["ffn_norm"], X, attn_pre)
        y, _ = moe(dm, s["moe"], x)
        X = mhc.update(X, y, post, comb)
    return mhc.collapse(X, pre)


def base_logits(cfg: ModelConfig, p: dict, head: Array, h: Array) -> Array:
    """`U = LM_head(norm(h))` [..., V] float32 (the backbone's LM head, the drafter's final norm)."""
    return linear(rms_norm(h, p["norm"], cfg.rms_norm_eps), head, cfg.dtype)


def heads(cfg: ModelConfig, p: dict, U: Array, h: Array, prev: Array) -> tuple[Array, Array]:
    """Markov logits `U + W2·W1[prev]` [..., V] and confidence `σ(w·[h ; W1[prev]])` [...] (SPEC §12)."""
    e = p["markov_embed"][prev]  # [..., r]
    logits = U + linear(e, p["markov_head"], cfg.dtype)
    both = jnp.concatenate([h.astype(jnp.float32), e.astype(jnp.float32)], axis=-1)
    return logits, jax.nn.sigmoid(both @ p["confidence"].astype(jnp.float32))


# ---------------------------------------------------------------------------------------------
# Inference: one block per row

@chex.dataclass(frozen=True)
class Proposal:
    """γ drafts per row: tokens [B, γ] int32, the logits each was drawn from [B, γ, V] (Markov-adjusted,
    untempered), and the confidences c_k [B, γ] (SPEC §12)."""

    tokens: Array
    logits: Array
    confidence: Array


def window_rows(length: Array, floor: Array, window: int, slots: int) -> Array:
    """Ring rows [B, W] of the context positions `[length − W, length − 1]`, −1 below `max(floor, 0)`."""
    pos = length[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None]
    return jnp.where(pos >= jnp.maximum(floor, 0)[:, None], pos % slots, NO_ENTRY)


def propose(cfg: ModelConfig, params: dict, state, anchor: Array, key: Array, temperature: Array,
            top_p: Array, *, quantize: bool) -> Proposal:
    """Draft γ = `dspark_block_size` tokens after `anchor [B]` (the sampled token at position `length`), from
    the drafter's context windows in `state`; Markov logits sampled left to right (`csa2.sampling`).
    `quantize`: the block's own window KV in the SPEC §8 numerics (False: the float model)."""
    p, gamma, b = params[DRAFTER], cfg.dspark_block_size, anchor.shape[0]
    chex.assert_shape(anchor, (state.batch,))
    block = jnp.concatenate([anchor[:, None].astype(jnp.int32),
                             jnp.full((b, gamma - 1), cfg.dspark_noise_token_id, jnp.int32)], axis=1)
    positions = state.length[:, None] + jnp.arange(gamma, dtype=jnp.int32)[None]
    rows = window_rows(state.length, state.floor, cfg.sliding_window, state.draft.rows)
    ctx_idx = jnp.broadcast_to(rows[:, None], (b, gamma, rows.shape[1]))
    contexts = [_stage(state.draft, i) for i in range(cfg.num_nextn_predict_layers)]
    h = hidden(cfg, p, params["embed"], block, positions, contexts, ctx_idx, quantize)
    U = base_logits(cfg, p, params["head"], h)  # [B, γ, V]

    def step(prev, xs):
        U_k, h_k, key_k = xs
        logits, c = heads(cfg, p, U_k, h_k, prev)
        token = sample(logits, key_k, temperature, top_p)
        return token, (token, logits, c)

    keys = jax.random.split(key, gamma)
    _, (tokens, logits, c) = jax.lax.scan(step, anchor.astype(jnp.int32),
                                          (jnp.moveaxis(U, 1, 0), jnp.moveaxis(h, 1, 0), keys))
    return Proposal(tokens=tokens.T, logits=jnp.moveaxis(logits, 0, 1), confidence=c.T)


# ---------------------------------------------------------------------------------------------
# Training: many anchors per sequence, teacher-forced Markov inputs

def anchored(cfg: ModelConfig, params: dict, features: Array, tokens: Array, anchors: Array, *,
             quantize: bool) -> tuple[Array, Array]:
    """The drafter on blocks at `anchors [B, A]` of teacher-forced sequences `tokens [B, S]` with their target
    features `features [B, S, n_t, d]` (`csa2.model.forward(..., features=True)`).

    Block a holds `[tokens[a], noise × (γ−1)]` at positions a … a+γ−1 and sees the context `[a − W, a − 1]`
    and its own block only; its Markov inputs are the true previous tokens `tokens[a + k]`. Returns the draft
    logits [B, A, γ, V] (slot k predicts `tokens[a + 1 + k]`) and the confidences [B, A, γ]. Slots past the end
    of the sequence compute on clipped inputs: the caller masks them.
    """
    p, gamma = params[DRAFTER], cfg.dspark_block_size
    b, s = tokens.shape
    a_n = anchors.shape[1]
    ctx = context(cfg, p, features)  # [B, S, d]
    freqs = layer_frequencies(cfg, 0)
    seq_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    like = Stored.empty((b, 0), cfg.head_dim, WINDOW, packed=False)
    contexts = [cache.encode(window_kv(cfg, p["stages"][i]["attn"], ctx, seq_pos, freqs), like, quantize)
                for i in range(cfg.num_nextn_predict_layers)]
    offsets = jnp.arange(gamma, dtype=jnp.int32)
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, A]
    block = jnp.concatenate([anchor_tok[..., None], jnp.full((b, a_n, gamma - 1), cfg.dspark_noise_token_id,
                                                             jnp.int32)], axis=-1).reshape(b, a_n * gamma)
    positions = (anchors[..., None] + offsets).reshape(b, a_n * gamma)
    pos = anchors[..., None] - cfg.sliding_window + jnp.arange(cfg.sliding_window, dtype=jnp.int32)  # [B, A, W]
    ctx_idx = jnp.repeat(jnp.where(pos >= 0, pos, NO_ENTRY), gamma, axis=1)  # [B, A·γ, W]
    h = hidden(cfg, p, params["embed"], block, positions, contexts, ctx_idx, quantize)
    U = base_logits(cfg, p, params["head"], h).reshape(b, a_n, gamma, -1)
    prev = jnp.take_along_axis(tokens, jnp.clip(anchors[..., None] + offsets, 0, s - 1).reshape(b, -1),
                               axis=1).reshape(b, a_n, gamma)
    return heads(cfg, p, U, h.reshape(b, a_n, gamma, -1), prev)
