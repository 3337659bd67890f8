"""A plain-numpy float64 DSpark drafter (SPEC §3, §7, §8, §9, §10, §12), written from the SPEC's
formulas, for `test_dspark_oracle.py`. It imports nothing from csa2: it reads the drafter's parameters as a
dict of numpy arrays (`csa2.params.arrays(params)["drafter"]`, csa2's storage orientation `x @ w`) and a
config object for its field values only.

Every function takes one row (no batch axis); `draft_hidden` is the expensive part (the stages), `heads` the
cheap Markov / confidence heads that depend on the Markov inputs.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
FP8_BLOCK = 32
FP8_AMAX_FLOOR = 1e-4
E4M3_MIN_EXP = -6  # smallest normal exponent of e4m3fn; below it the step is 2^-9

# How close each FP8 rounding decision came to flipping, appended by `fp8_window`: the distance of a payload
# from the nearest e4m3 rounding midpoint, in units of the local e4m3 step, and of log2(amax / 448) from the
# nearest integer (where the UE8M0 scale would change). Diagnostics for the tests' tolerance, nothing else.
MARGINS: list[float] = []


# ---------------------------------------------------------------------------------------------
# Elementary pieces

def rms(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x²) + eps) · w."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def rope(x: np.ndarray, pos: np.ndarray, rope_dim: int, theta: float, sign: float = 1.0) -> np.ndarray:
    """SPEC §7: rotate the trailing `rope_dim` channels as interleaved pairs (x[2i], x[2i+1]) by the angle
    sign · pos · theta^(-2i/rope_dim). x [..., D], pos broadcastable to x.shape[:-1]."""
    i = np.arange(rope_dim // 2, dtype=np.float64)
    ang = sign * np.asarray(pos, np.float64)[..., None] * theta ** (-2.0 * i / rope_dim)  # [..., rope/2]
    c, s = np.cos(ang), np.sin(ang)
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    out = np.empty_like(tail)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return np.concatenate([head, out], axis=-1)


def fp8_window(x: np.ndarray) -> np.ndarray:
    """SPEC §8 SWA / window storage, fake-quantized: per 32 channels a UE8M0 (power-of-two) scale
    2^ceil(log2(max(amax, 1e-4) / 448)), payload x / scale rounded to nearest-even e4m3 (ml_dtypes' cast from
    float64 rounds once, RNE), decoded back to payload · scale."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // FP8_BLOCK, FP8_BLOCK)
    amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(amax, FP8_AMAX_FLOOR) / E4M3_MAX))
    v = np.clip(blocks / scale, -E4M3_MAX, E4M3_MAX)
    payload = v.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    step = 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** E4M3_MIN_EXP))), E4M3_MIN_EXP) - 3)
    log_ratio = np.log2(np.maximum(amax, FP8_AMAX_FLOOR) / E4M3_MAX)
    if v.size:
        MARGINS.append(float(min(np.abs((np.abs(v) / step) % 1.0 - 0.5).min(),
                                 np.abs(log_ratio - np.round(log_ratio)).min())))
    return (payload * scale).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# mHC (SPEC §10)

def hc_coefficients(cfg, hc: dict, X: np.ndarray):
    """pre [T, n], post [T, n], comb [T, n, n] of streams X [T, n, d]; `hc["fn"]` is [n·d, (2+n)·n] (x @ fn)."""
    n = cfg.hc_mult
    flat = X.reshape(X.shape[0], -1)
    mixes = (flat @ hc["fn"]) / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    a, b, eps = hc["scale"], hc["base"], cfg.hc_eps
    pre = sigmoid(mixes[:, :n] * a[0] + b[:n]) + eps
    post = 2.0 * sigmoid(mixes[:, n:2 * n] * a[1] + b[n:2 * n])
    z = (mixes[:, 2 * n:] * a[2] + b[2 * n:]).reshape(-1, n, n)  # z[t, j, k]
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    comb = z / z.sum(axis=-1, keepdims=True) + eps  # row softmax (+eps)
    for it in range(cfg.hc_sinkhorn_iters):  # 20 Sinkhorn iterations: the softmax is the first row step
        if it:
            comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)  # rows
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)  # columns
    return pre, post, comb


def hc_update(X: np.ndarray, f: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """X'_k = post_k · f + Σ_j comb[j, k] · X_j."""
    return post[:, :, None] * f[:, None, :] + np.einsum("tjk,tjd->tkd", comb, X)


def collapse(X: np.ndarray, pre: np.ndarray) -> np.ndarray:
    return np.einsum("tk,tkd->td", pre, X)


# ---------------------------------------------------------------------------------------------
# The drafter

def context(cfg, p: dict, feats: np.ndarray) -> np.ndarray:
    """Target features [T, n_t, d] (stream means of the target layers' attention-site inputs) → [T, d]."""
    return rms(feats.reshape(feats.shape[0], -1) @ p["main_proj"], p["main_norm"], cfg.rms_norm_eps)


def window_kv(cfg, a: dict, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """A SWA attention's stored K = V latent: RMSNorm(x @ wkv), RoPE θ at `pos`, FP8 (SPEC §3, §8)."""
    kv = rms(x @ a["wkv"], a["kv_norm"], cfg.rms_norm_eps)
    return fp8_window(rope(kv, pos, cfg.qk_rope_head_dim, cfg.rope_theta))


def attention(cfg, a: dict, x: np.ndarray, pos: np.ndarray, ctx_kv: np.ndarray) -> np.ndarray:
    """The draft block's attention (SPEC §3, §12): queries x [γ, d] at `pos`, entries = ctx_kv [C, D] (already
    restricted to the window) ∪ the block's own γ entries, bidirectional, one softmax with the sink in the
    denominator; inverse RoPE on the value; grouped output projection. → [γ, d]."""
    H, D, g, eps = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.rms_norm_eps
    q = (rms(x @ a["wq_a"], a["q_norm"], eps) @ a["wq_b"]).reshape(len(x), H, D)
    q = rope(q, pos[:, None], cfg.qk_rope_head_dim, cfg.rope_theta)
    kv = np.concatenate([ctx_kv, window_kv(cfg, a, x, pos)], axis=0)  # [C + γ, D]
    logits = np.einsum("thd,ed->the", q, kv) / np.sqrt(D)
    sink = a["sink"][None, :, None]
    m = np.maximum(logits.max(axis=-1, keepdims=True), sink)
    w = np.exp(logits - m)
    o = np.einsum("the,ed->thd", w, kv) / (w.sum(axis=-1, keepdims=True) + np.exp(sink - m))
    o = rope(o, -pos[:, None], cfg.qk_rope_head_dim, cfg.rope_theta)  # conjugate rotation
    grouped = o.reshape(len(x), g, H // g * D)
    mid = np.einsum("tgi,gio->tgo", grouped, a["wo_a"]).reshape(len(x), -1)
    return mid @ a["wo_b"]


def swiglu(x: np.ndarray, w1: np.ndarray, w3: np.ndarray, w2: np.ndarray, limit: float, scale=1.0) -> np.ndarray:
    """w2(silu(min(x w1, L)) · clip(x w3, ±L)), the hidden scaled by `scale` (SPEC §9)."""
    return (silu(np.minimum(x @ w1, limit)) * np.clip(x @ w3, -limit, limit) * scale) @ w2


def moe(cfg, m: dict, x: np.ndarray, n_experts: int, top_k: int) -> np.ndarray:
    """SPEC §9: s = sqrt(softplus(x W_r / temp)); experts = top-k of s + bias (selection only); weights
    s / Σs · routed_scaling; routed SwiGLU experts plus the always-on shared expert. x [T, d]."""
    s = np.sqrt(softplus((x @ m["router"]) / cfg.gate_temp))  # [T, E]
    assert s.shape[-1] == n_experts
    out = np.zeros_like(x)
    for t in range(len(x)):
        chosen = np.argsort(-(s[t] + m["bias"]), kind="stable")[:top_k]
        wts = s[t, chosen] / (s[t, chosen].sum() + 1e-20) * cfg.routed_scaling_factor
        for e, w in zip(chosen, wts):
            out[t] += swiglu(x[t], m["w1"][e], m["w3"][e], m["w2"][e], cfg.swiglu_limit, w)
    sh = m["shared"]
    return out + swiglu(x, sh["w1"], sh["w3"], sh["w2"], cfg.swiglu_limit)


def draft_hidden(cfg, p: dict, embed: np.ndarray, ctx: np.ndarray, anchor: int, length: int,
                 position_offset: int = 0) -> np.ndarray:
    """h [γ, d]: the collapsed pre-norm state of the block [C, noise × (γ−1)] at positions L … L+γ−1
    (+ `position_offset`), each stage attending to its own window of the context rows [L−W, L−1] (those ≥ 0)
    of `ctx [≥L, d]` and to its whole block. Single-pass mHC: the embedding as hc_mult streams, the attention
    site collapsed with the incoming pre (one-hot first), the MoE site with the attention site's pre, the
    result with the last site's pre."""
    gamma, n, eps = cfg.dspark_block_size, cfg.hc_mult, cfg.rms_norm_eps
    tokens = np.array([anchor] + [cfg.dspark_noise_token_id] * (gamma - 1))
    pos = length + np.arange(gamma) + position_offset
    ctx_pos = np.arange(max(length - cfg.sliding_window, 0), length)
    X = np.repeat(embed[tokens][:, None, :], n, axis=1)  # [γ, n, d]
    pre = np.zeros((gamma, n))
    pre[:, 0] = 1.0
    for s in p["stages"]:
        ctx_kv = window_kv(cfg, s["attn"], ctx[ctx_pos], ctx_pos)  # this stage's own context window
        attn_pre, post, comb = hc_coefficients(cfg, s["attn_hc"], X)
        x = rms(collapse(X, pre), s["attn_norm"], eps)
        X = hc_update(X, attention(cfg, s["attn"], x, pos, ctx_kv), post, comb)
        pre, post, comb = hc_coefficients(cfg, s["ffn_hc"], X)
        x = rms(collapse(X, attn_pre), s["ffn_norm"], eps)
        X = hc_update(X, moe(cfg, s["moe"], x, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok),
                      post, comb)
    return collapse(X, pre)


def heads(cfg, p: dict, head: np.ndarray, h: np.ndarray, prev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Markov logits U_k + W2 W1[x_{k−1}] [γ, V] and confidences σ(w·[h_k ; W1[x_{k−1}]]) [γ];
    U = LM_head(RMSNorm(h, drafter norm)), `prev` = (C, x_0, …, x_{γ−2})."""
    U = rms(h, p["norm"], cfg.rms_norm_eps) @ head
    e = p["markov_embed"][prev]  # [γ, r]
    logits = U + e @ p["markov_head"]
    conf = sigmoid(np.concatenate([h, e], axis=-1) @ p["confidence"])
    return logits, conf
