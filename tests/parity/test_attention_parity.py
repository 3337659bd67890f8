"""Parity of csa2's attention pieces against transformers' DeepSeek-V4 (torch CPU, float32).

Where V4 and SPEC §3/§4 coincide (research notes /work/notes/hf_v4.md §1-§3):
- core attention with a per-head sink in the denominator only: `eager_attention_forward`;
- grouped output projection: `DeepseekV4GroupedLinear` (`o_a_proj`) + `o_b_proj`;
- compressor pooling + kv norm + RoPE: `DeepseekV4HCACompressor` with compress rate 2 (non-overlapping
  windows, `position_bias` zeroed) and rate 1. Indexer keys are V4.1-only and not compared.

Our random JAX weights are copied into the torch modules (never the other way round). Every test
also checks that plausible mistakes (sink in the numerator, heads grouped interleaved, softmax over
channels, RoPE at the wrong position or with the wrong frequencies, ...) land far outside the
tolerance on the same inputs, so a bug of that kind in our code would make the parity test fail.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from csa2.attention import grouped_output
from csa2.compressor import Compressor, compress
from csa2.config import YarnScaling
from csa2.presets import preset
from csa2.rope import apply_rope, rope_frequencies
from csa2.state import init_state
from pallas_kernels.reference import sink_attention

ATOL = 1e-5
MUTANT_MIN = 1e-3  # a wrong implementation must miss the reference by at least 100× the tolerance

# Compressor RoPE: V4's HCA compressor rotates with `rotary_emb(..., layer_type="compress")`, i.e. the
# config's "compress" parameters: θ = `compress_rope_theta`, YaRN (factor, original_max_position_embeddings,
# beta_fast, beta_slow) from the flat `rope_parameters` dict, `attention_factor` forced to 1.0 (no mscale),
# `truncate` = True, rope dim = head_dim · partial_rotary_factor = `qk_rope_head_dim`. SPEC §7 uses
# `compress_rope_theta` + `rope_scaling` (YaRN, unit magnitude) for ratio≠0 layers, so ours is set to the
# same numbers. Two settings: the released ones, and a strong one (small θ, YaRN ramp over the
# high-frequency pairs) under which position/frequency mistakes are large at positions < 16.
ROPE_SETTINGS = {
    "released": (160000.0, YarnScaling(16.0, 65536, 32.0, 1.0)),
    "strong": (100.0, YarnScaling(4.0, 64, 32.0, 1.0)),
}

# Our config: the `mini` preset (KV sources: layer 1 ratio 2, layer 4 ratio 1), float32.
BASE = preset("mini").replace(dtype="float32")
SOURCE = {2: 0, 1: 1}  # ratio -> stack of that KV source in the state (one source per stack: slot 0)
SLOT = 0


@functools.partial(jax.jit, static_argnums=(0, 2), static_argnames="quantize")
def _compress(cfg, params, ratio, gkv, tail, x, start, n_valid, *, quantize):
    """`compress` on source SLOT of the stack `gkv`; returns the stack and the source's tail."""
    source, tail = compress(cfg, params, ratio, gkv.source(SLOT), tail, x, start, n_valid, quantize=quantize)
    return source.stack(), tail


def _ours(rope="released"):
    theta, yarn = ROPE_SETTINGS[rope]
    return BASE.replace(compress_rope_theta=theta, rope_scaling=yarn)


def _hf_config(cfg, hca_rate=2):
    """A one-layer V4 config with the same dims, eps and compress RoPE as our `cfg`."""
    y = cfg.rope_scaling
    hf = DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=1,
        num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        moe_intermediate_size=cfg.moe_intermediate_size, n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, sliding_window=cfg.sliding_window,
        layer_types=["heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca_rate},
        mlp_layer_types=["moe"], rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=int(y.factor * y.original_max_position_embeddings),  # YaRN's implied context
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        rope_parameters={"rope_type": "yarn", "factor": y.factor,
                         "original_max_position_embeddings": y.original_max_position_embeddings,
                         "beta_fast": y.beta_fast, "beta_slow": y.beta_slow},
    )
    hf._attn_implementation = "eager"
    hf._experts_implementation = "eager"
    return hf


def _t(a):
    return torch.from_numpy(np.array(a, dtype=np.float32))


def _max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ---------------------------------------------------------------------------------------------
# 1. Core attention with a per-head sink (SPEC §3) vs `eager_attention_forward`

B, S, T, H, D = 2, 5, 7, 4, 32
SINKS = np.array([-1.5, 0.0, 1.0, 2.5], np.float32)  # sinks comparable to the logits: they matter


def _sink_inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, S, H, D)).astype(np.float32)
    keys = rng.standard_normal((B, T, D)).astype(np.float32)  # one entry set, shared by every query
    valid = rng.random((B, S, T)) < 0.6
    valid[0, 2] = False  # a fully masked row: both must return 0
    valid[1, 0] = False
    valid[1, 0, 3] = True  # a single visible entry
    valid[1, 4] = True  # everything visible
    return q, keys, valid


def _hf_sink_attention(q, keys, valid, sinks):
    """`eager_attention_forward` on [B,H,S,D] queries, K = V [B,1,T,D], additive 0/−inf mask [B,1,S,T]."""
    module = types.SimpleNamespace(sinks=_t(sinks), num_key_value_groups=q.shape[2], training=False)
    kv = _t(keys)[:, None]
    mask = torch.from_numpy(np.where(valid, 0.0, -np.inf).astype(np.float32))[:, None]
    with torch.no_grad():
        out, _ = v4.eager_attention_forward(module, _t(q).transpose(1, 2), kv, kv, mask, scaling=q.shape[-1] ** -0.5)
    return out.numpy()  # [B, S, H, D]


def _ours_sink(q, keys, valid, sinks):
    keys_q = np.broadcast_to(keys[:, None], (q.shape[0], q.shape[1]) + keys.shape[1:])  # [B, S, T, D]
    return np.asarray(sink_attention(jnp.asarray(q), jnp.asarray(keys_q), jnp.asarray(valid), jnp.asarray(sinks)))


def _sink_mutant(q, keys, valid, sinks, kind):
    """Plausible wrong versions of SPEC §3's sink attention, float64 numpy."""
    q, k, s = q.astype(np.float64), keys.astype(np.float64), sinks.astype(np.float64)
    logits = np.einsum("bshd,btd->bsht", q, k) * D**-0.5
    if kind == "scaled_sink":
        s = s * D**-0.5
    if kind == "sink_head_permuted":
        s = s[::-1]
    logits = np.where(valid[:, :, None, :], logits, -np.inf)
    m = np.maximum(logits.max(-1), s)
    p = np.exp(logits - m[..., None])
    e_sink = np.exp(s - m)
    denom = p.sum(-1) + (0.0 if kind == "no_sink" else e_sink)
    num = np.einsum("bsht,btd->bshd", p, k)
    if kind == "sink_in_numerator":  # the sink contributes to the output as an entry of value 1
        num = num + e_sink[..., None]
    out = num / np.where(denom > 0, denom, 1.0)[..., None]
    if kind == "no_sink":
        out = np.where(valid.any(-1)[:, :, None, None], out, 0.0)
    return out


def test_sink_attention_matches_eager_attention_forward():
    q, keys, valid = _sink_inputs()
    ref = _hf_sink_attention(q, keys, valid, SINKS)
    ours = _ours_sink(q, keys, valid, SINKS)
    assert ours.shape == ref.shape == (B, S, H, D)
    assert np.all(np.isfinite(ours))
    # The fully masked row is exactly 0 on both sides.
    assert np.all(ref[0, 2] == 0.0) and np.all(ours[0, 2] == 0.0)
    diff = _max_diff(ours, ref)
    assert diff <= ATOL, f"sink attention: max |ours − V4| = {diff:.3g}"


def test_sink_attention_per_query_entries():
    """Each query reads its own entry set ([B,S,E,D]): compare one V4 call per query."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, S, H, D)).astype(np.float32) * 2.0  # sharper softmax
    keys = rng.standard_normal((B, S, T, D)).astype(np.float32)
    valid = rng.random((B, S, T)) < 0.5
    valid[1, 3] = False
    sinks = rng.standard_normal(H).astype(np.float32)
    ours = np.asarray(sink_attention(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(valid), jnp.asarray(sinks)))
    ref = np.concatenate([_hf_sink_attention(q[:, s:s + 1], keys[:, s], valid[:, s:s + 1], sinks)
                          for s in range(S)], axis=1)
    assert np.all(ref[1, 3] == 0.0) and np.all(ours[1, 3] == 0.0)
    diff = _max_diff(ours, ref)
    assert diff <= ATOL, f"per-query sink attention: max |ours − V4| = {diff:.3g}"


@pytest.mark.parametrize("kind", ["no_sink", "sink_in_numerator", "scaled_sink", "sink_head_permuted"])
def test_sink_attention_inputs_detect_mistakes(kind):
    q, keys, valid = _sink_inputs()
    ref = _hf_sink_attention(q, keys, valid, SINKS)
    assert _max_diff(_sink_mutant(q, keys, valid, SINKS, "exact"), ref) <= ATOL  # the mutant harness is right
    assert _max_diff(_sink_mutant(q, keys, valid, SINKS, kind), ref) > MUTANT_MIN


# ---------------------------------------------------------------------------------------------
# 2. Grouped output projection (SPEC §3) vs V4's `o_a_proj` (GroupedLinear) + `o_b_proj`


def _grouped_setup(seed=2):
    cfg = _ours()
    h, dh, g, r, d = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank, cfg.hidden_size
    k_a, k_b = jax.random.split(jax.random.PRNGKey(seed))
    params = {"wo_a": 0.1 * jax.random.normal(k_a, (g, h // g * dh, r), jnp.float32),
              "wo_b": 0.1 * jax.random.normal(k_b, (g * r, d), jnp.float32)}
    o = np.random.default_rng(seed).standard_normal((2, 3, h, dh)).astype(np.float32)
    return cfg, params, o


def _hf_grouped(cfg, params, o):
    """V4's attention output path (M:879-881) with our weights copied in."""
    torch.manual_seed(0)
    attn = v4.DeepseekV4Attention(_hf_config(cfg), 0).eval()
    g, r = cfg.o_groups, cfg.o_lora_rank
    wo_a = np.asarray(params["wo_a"])  # [g, in, r]; V4 weight.view(g, r, in)[j] = wo_a[j].T
    with torch.no_grad():
        attn.o_a_proj.weight.copy_(_t(wo_a.transpose(0, 2, 1).reshape(g * r, -1)))
        attn.o_b_proj.weight.copy_(_t(np.asarray(params["wo_b"]).T))
        x = _t(o)  # [B, S, H, D] as V4 holds it after the inverse RoPE
        grouped = x.reshape(*x.shape[:2], cfg.o_groups, -1)
        return attn.o_b_proj(attn.o_a_proj(grouped).flatten(2)).numpy()


def test_grouped_output_matches_v4():
    cfg, params, o = _grouped_setup()
    ref = _hf_grouped(cfg, params, o)
    ours = np.asarray(grouped_output(cfg, params, jnp.asarray(o)))
    assert ours.shape == ref.shape == (2, 3, cfg.hidden_size)
    diff = _max_diff(ours, ref)
    assert diff <= ATOL, f"grouped output: max |ours − V4| = {diff:.3g}"


def test_grouped_output_inputs_detect_mistakes():
    cfg, params, o = _grouped_setup()
    ref = _hf_grouped(cfg, params, o)
    h, g, r = cfg.num_attention_heads, cfg.o_groups, cfg.o_lora_rank
    # Heads assigned to groups interleaved (group j = heads j, j+g, ...) instead of contiguous.
    interleaved = np.arange(h).reshape(h // g, g).T.reshape(-1)
    bad = grouped_output(cfg, params, jnp.asarray(o[:, :, interleaved]))
    assert _max_diff(bad, ref) > MUTANT_MIN
    # Intermediate concatenated rank-major ([r, g]) instead of group-major ([g, r]).
    perm = np.arange(g * r).reshape(g, r).T.reshape(-1)
    bad = grouped_output(cfg, {**params, "wo_b": params["wo_b"][perm]}, jnp.asarray(o))
    assert _max_diff(bad, ref) > MUTANT_MIN


# ---------------------------------------------------------------------------------------------
# 3. Compressor pooling + kv norm + compress RoPE (SPEC §4) vs `DeepseekV4HCACompressor`

SEQ = 12
BATCH = 2


def _compressor_setup(ratio, rope, seed):
    cfg = _ours(rope)
    p = nnx.to_pure_dict(nnx.state(Compressor(cfg, ratio, rngs=nnx.Rngs(jax.random.PRNGKey(seed)))))
    rng = np.random.default_rng(seed)
    d, dh = cfg.hidden_size, cfg.head_dim
    k_kv, k_gate = jax.random.split(jax.random.PRNGKey(seed + 100))
    p["wkv"] = 0.2 * jax.random.normal(k_kv, (d, dh), jnp.float32)
    if ratio > 1:
        p["wgate"] = 0.3 * jax.random.normal(k_gate, (d, dh), jnp.float32)  # decisive, non-uniform gates
    p["norm"] = jnp.asarray(rng.uniform(0.5, 1.5, dh), jnp.float32)
    x = rng.standard_normal((BATCH, SEQ, d)).astype(np.float32)
    return cfg, p, x


def _hf_compressor(cfg, params, ratio, x):
    """V4 HCA compressor, stateless (entries of complete windows only), our weights copied in."""
    torch.manual_seed(0)
    comp = v4.DeepseekV4HCACompressor(_hf_config(cfg, hca_rate=ratio)).eval()
    assert comp.compress_rate == ratio
    with torch.no_grad():
        comp.kv_proj.weight.copy_(_t(np.asarray(params["wkv"]).T))
        if ratio > 1:
            comp.gate_proj.weight.copy_(_t(np.asarray(params["wgate"]).T))
        else:  # softmax over a single slot is 1 whatever the gate: give it garbage to prove it
            comp.gate_proj.weight.copy_(torch.randn(comp.gate_proj.weight.shape) * 10)
        comp.position_bias.zero_()  # SPEC: no position bias
        comp.kv_norm.weight.copy_(_t(params["norm"]))
        pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        kv, _ = comp(_t(x), None, pos, None, 0)
    return kv[:, 0].numpy()  # [B, S // ratio, D]


def _ours_compress(cfg, params, ratio, x, chunks=None, width=None):
    """Run our compressor over x [B, S, d] in chunks of the given real lengths, each padded to `width`
    tokens (padding = garbage, beyond n_valid); return the Main KV entries and the complete count."""
    state = init_state(cfg, x.shape[0], 16, "float")
    gkv = state.global_kv[SOURCE[ratio]]
    tail = jax.tree.map(lambda a: a[:, SLOT], state.tails[SOURCE[ratio]])  # this source's tail [B, slots, D]
    start = 0
    for n in chunks or [x.shape[1]]:
        part = x[:, start:start + n]
        if width is not None:
            part = np.concatenate([part, np.full((x.shape[0], width - n, x.shape[2]), 7.0, np.float32)], 1)
        gkv, tail = _compress(cfg, params, ratio, gkv, tail, jnp.asarray(part),
                              jnp.full((x.shape[0],), start, jnp.int32), jnp.full((x.shape[0],), n, jnp.int32),
                              quantize=False)
        start += n
    assert gkv.kv.scale is None  # float storage: the payload is the float32 entries
    return np.asarray(gkv.kv.payload[:, SLOT]), start // ratio


def _compress_mutant(cfg, params, ratio, x, kind):
    """Plausible wrong versions of SPEC §4, float64 numpy (RoPE through our own `apply_rope`)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    n = x.shape[1] // ratio
    kv = (x.astype(np.float64) @ p["wkv"])[:, : n * ratio].reshape(x.shape[0], n, ratio, -1)
    if ratio > 1:
        z = (x.astype(np.float64) @ p["wgate"])[:, : n * ratio].reshape(kv.shape)
        axis = -1 if kind == "softmax_over_channels" else 2
        w = np.exp(z - z.max(axis, keepdims=True))
        w = w / w.sum(axis, keepdims=True)
        pooled = (w * kv).sum(2)
    else:
        pooled = kv[:, :, 0]
    latent = pooled / np.sqrt(np.mean(pooled**2, -1, keepdims=True) + cfg.rms_norm_eps) * p["norm"]
    pos = np.arange(n) * ratio + (ratio - 1 if kind == "rope_at_last_member" else 0)
    if kind == "main_rope":
        freqs = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta)
    elif kind == "no_yarn":
        freqs = rope_frequencies(cfg.qk_rope_head_dim, cfg.compress_rope_theta)
    else:
        freqs = rope_frequencies(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)
    return np.asarray(apply_rope(jnp.asarray(latent, jnp.float32), jnp.asarray(pos[None]), freqs))


@pytest.mark.parametrize("rope", list(ROPE_SETTINGS))
@pytest.mark.parametrize("ratio", [2, 1])
def test_compressor_matches_hca(ratio, rope):
    cfg, params, x = _compressor_setup(ratio, rope, seed=3 + ratio)
    ref = _hf_compressor(cfg, params, ratio, x)
    kv, n = _ours_compress(cfg, params, ratio, x)
    assert n == SEQ // ratio == ref.shape[1]
    diff = _max_diff(kv[:, :n], ref)
    assert diff <= ATOL, f"ratio {ratio} ({rope} rope): max |ours − V4| = {diff:.3g}"
    assert np.all(kv[:, n:] == 0.0)  # nothing written past the complete groups


def test_compressor_streamed_matches_hca():
    """Ours over chunks of 5 + 1 + 5 + 2 real tokens, each padded to 5 (groups split across chunks are
    completed from the tail; a 13th, unpaired token stays in the tail as V4 drops it) vs V4 on the
    whole 12-token sequence."""
    cfg, params, x = _compressor_setup(2, "strong", seed=7)
    ref = _hf_compressor(cfg, params, 2, x)
    kv, n = _ours_compress(cfg, params, 2, np.concatenate([x, x[:, :1]], 1), chunks=[5, 1, 5, 2], width=5)
    assert n == SEQ // 2
    diff = _max_diff(kv[:, :n], ref)
    assert diff <= ATOL, f"streamed ratio 2: max |ours − V4| = {diff:.3g}"


@pytest.mark.parametrize("kind,ratio", [("softmax_over_channels", 2), ("rope_at_last_member", 2),
                                        ("main_rope", 2), ("no_yarn", 2), ("main_rope", 1), ("no_yarn", 1)])
def test_compressor_inputs_detect_mistakes(kind, ratio):
    cfg, params, x = _compressor_setup(ratio, "strong", seed=3 + ratio)
    ref = _hf_compressor(cfg, params, ratio, x)
    assert _max_diff(_compress_mutant(cfg, params, ratio, x, "exact"), ref) <= ATOL
    assert _max_diff(_compress_mutant(cfg, params, ratio, x, kind), ref) > MUTANT_MIN
