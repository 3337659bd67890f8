"""Engram n-gram memory (SPEC §10b): exact n-gram hashing, table lookup and the gated write.

Hashing (V4.1 `DeepseekV41NgramHashState`)
------------------------------------------
Tokens are ids of the compressed Engram vocabulary `[0, V_c)`, `V_c = engram_compressed_vocab_size`
(token ids mapped by `csa2.engram_vocab`; the identity for a byte vocabulary); positions before the
sequence start hold `engram_pad_id` (mapped likewise).
For position t, n-gram size n ∈ 2..N (`N = engram_max_ngram_size`) and head j:

    h[t, n, j] = (XOR_{i<n} tok_{t−i} · m_i)  mod  p_{layer, n, j}  +  offset_{n, j}

- Multipliers (`engram_multipliers`): one per look-back i ∈ [0, N), shared by every n and head of
  the layer (V4.1 `compute_hash_multipliers`): `np.random.default_rng(10007·layer).integers(0,
  max(1, (2^63−1) // V_c // 2), size=N, dtype=int64) · 2 + 1`. So every product `tok · m_i` of a
  token `< V_c` is `< 2^63`, and XORs of such values stay `< 2^63`: int64 arithmetic never wraps.
- The n-gram value is a rolling XOR: the (n+1)-gram value is the n-gram value XOR `tok_{t−n}·m_n`.
- Primes (`engram_primes`): the V4.1 `EngramLayout` search. Walking layers in `engram_layer_ids`
  order, then n = 2..N, then head 0..H−1, each prime is the smallest prime ≥ `engram_vocab_size`
  not used before (V4.1 restarts every n-gram's search at `engram_vocab_size` and skips used
  primes). The result is the K = |layers|·(N−1)·H consecutive primes ≥ `engram_vocab_size`, in
  that order: each is larger than the previous one, all are distinct across the model.
- Rows: each layer owns one table, the concatenation of its (n, head) sub-tables in n-major,
  head-minor order (V4.1 `offsets`): `offset_{n,j}` = sum of the primes before (n, j) in that order.
  `engram_hashes` returns these global row ids, `[B, S, (N−1)·H]` int32, in the same column order.

Exact 64-bit arithmetic without jax x64
---------------------------------------
Values are uint32 pairs `(hi, lo)` meaning `hi·2^32 + lo`; every uint32 op below wraps mod 2^32
and the method never relies on a wrap except where the discarded bits are provably zero.
1. `a · b` for uint32 a, b (exact 64-bit result): split into 16-bit limbs `a = a1·2^16 + a0`,
   `b = b1·2^16 + b0`. The four partial products `a_i·b_j < 2^32` fit uint32.
   `mid = (a0b0 >> 16) + (a0b1 & 0xFFFF) + (a1b0 & 0xFFFF)` (< 3·2^16),
   `lo = (a0b0 & 0xFFFF) | (mid << 16)` (mod 2^32), `hi = a1b1 + (a0b1 >> 16) + (a1b0 >> 16) + (mid >> 16)`
   (< 2^32 because the full product is < 2^64).
2. `tok · m` with m = `m_hi·2^32 + m_lo`: `(h1, l1) = tok·m_lo`, `(h2, l2) = tok·m_hi`; the product is
   `(h1 + l2 mod 2^32, l1)`. The dropped `h2·2^64` term is 0 because `tok·m < 2^63`.
3. XOR acts on the pairs limb by limb.
4. `(hi·2^32 + lo) mod p`, p < 2^31, by Horner reduction in k-bit digits, `k = 32 − bitlen(p_max)`
   (p_max = the layer's largest prime, so every prime of the layer has ≥ k free high bits):
   `r = hi mod p` (native uint32 remainder), then for the 32 bits of `lo`, most significant digit
   first, `r = ((r << w) | digit) mod p` for digit widths w ≤ k. Since `r < p < 2^(32−k)`,
   `r << w < 2^32` and its low w bits are zero, so `| digit` is an exact add and nothing overflows.
   Released primes (~1.6·10^7 < 2^24) give k = 8: four byte steps; the tiny preset (~10^3) gives k = 22.
Everything is elementwise uint32 with static shapes and static primes/multipliers: jit-able.

Gated write (V4.1 `DeepseekV41Engram`)
--------------------------------------
Tables: float32 parameters (`engram_table_format="float"`, trainable), or packed as the release stores
them (`"fp8"`: e4m3 rows with one UE8M0 scale per 32 values, ~1/4 of the memory; the rows a step
reads are gathered as bits and decoded after the gather, never the whole table).
The (N−1)·H rows `[engram_head_dim]` are gathered and concatenated, `wkv` `[(N−1)·H·hd, (hc+1)·d]`
projects them, keys first (`hc` keys of d, stream-major) then the shared value (d). Per stream k,
`a = ⟨RMSNorm(X_k; q_weight_k), RMSNorm(key_k; k_weight_k)⟩ / sqrt(d)` with per-stream learned
weights `q_weight, k_weight [hc, d]` (initialised to ones; V4.1 only ever uses their product),
eps = `rms_norm_eps`, and `g = σ(copysign(sqrt(max(|a|, 1e-6)), a))` — V4.1 uses copysign, so
a = +0 gives σ(+1e-3), not σ(0). `X_k ← X_k + g · value`, gating in float32. An optional `mask`
[B, S] shuts the gate (V4.1 `token_mask`). No short convolution (V4.1 removed it).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from csa2.config import ModelConfig
from csa2.norm import rms_norm
from csa2.params import Normal, constant, linear, normal, ones
from pallas_kernels.formats import WINDOW
from pallas_kernels.stored import Stored

Array = jax.Array

GATE_CLAMP = 1e-6  # V4.1 `clamp_value`: |a| is clamped before the signed square root
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic Miller–Rabin for n < 3.3e24


# ---------------------------------------------------------------------------------------------
# Layout: primes, offsets, multipliers (static, host side)

def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def n_tables(cfg: ModelConfig) -> int:
    """Hash columns (= sub-tables) per Engram layer: (N − 1) n-gram sizes × heads."""
    return (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads


@functools.lru_cache(maxsize=None)
def _model_primes(cfg: ModelConfig) -> dict[int, tuple[int, ...]]:
    """Every Engram layer's primes (see the module docstring for the search order)."""
    primes: dict[int, tuple[int, ...]] = {}
    candidate = cfg.engram_vocab_size
    for layer in cfg.engram_layer_ids:
        found = []
        for _ in range(n_tables(cfg)):
            while not _is_prime(candidate):
                candidate += 1
            found.append(candidate)
            candidate += 1
        if found[-1] >= 2**31:
            raise ValueError(f"ModelConfig.engram_vocab_size={cfg.engram_vocab_size}: Engram primes reach {found[-1]} "
                             "≥ 2^31; the exact uint32 hash needs primes < 2^31, use a smaller engram_vocab_size")
        if sum(found) >= 2**31:
            raise ValueError(f"ModelConfig.engram_vocab_size={cfg.engram_vocab_size}: layer {layer}'s table has "
                             f"{sum(found)} rows ≥ 2^31, beyond int32 row ids; use a smaller engram_vocab_size or "
                             "fewer heads")
        primes[layer] = tuple(found)
    return primes


def _check_layer(cfg: ModelConfig, layer: int) -> None:
    if layer not in cfg.engram_layer_ids:
        raise ValueError(f"layer={layer!r} is not an Engram layer; use one of engram_layer_ids={cfg.engram_layer_ids}")


def engram_primes(cfg: ModelConfig, layer: int) -> tuple[int, ...]:
    """The layer's `(N−1)·H` table sizes, n-major then head (n = 2..N), all distinct in the model."""
    _check_layer(cfg, layer)
    return _model_primes(cfg)[layer]


def engram_offsets(cfg: ModelConfig, layer: int) -> tuple[int, ...]:
    """First row of each (n, head) sub-table inside the layer's concatenated table."""
    primes = engram_primes(cfg, layer)
    return tuple(int(x) for x in np.cumsum((0,) + primes[:-1]))


def engram_table_rows(cfg: ModelConfig, layer: int) -> int:
    """Rows of the layer's concatenated table (Σ primes)."""
    return sum(engram_primes(cfg, layer))


def engram_multipliers(cfg: ModelConfig, layer: int) -> np.ndarray:
    """`[N]` int64 odd multipliers, index i multiplies `tok_{t−i}` (V4.1: one row per layer)."""
    _check_layer(cfg, layer)
    bound = max(1, (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2)
    values = np.random.default_rng(10007 * layer).integers(0, bound, size=(cfg.engram_max_ngram_size,), dtype=np.int64)
    return values * 2 + 1


# ---------------------------------------------------------------------------------------------
# Exact 64-bit arithmetic on uint32 pairs

_MASK16 = np.uint32(0xFFFF)


def _mul32(a: Array, b: Array) -> tuple[Array, Array]:
    """Exact 64-bit product `(hi, lo)` of two uint32 arrays (16-bit limbs)."""
    a0, a1 = a & _MASK16, a >> 16
    b0, b1 = b & _MASK16, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & _MASK16) + (p10 & _MASK16)
    lo = (p00 & _MASK16) | (mid << 16)
    hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)
    return hi, lo


def _mul_tok(tok: Array, m: int) -> tuple[Array, Array]:
    """`tok · m` as a (hi, lo) pair, for uint32 `tok` and a constant `m`, exact when `tok·m < 2^64`."""
    m_hi, m_lo = np.uint32(m >> 32), np.uint32(m & 0xFFFFFFFF)
    h1, l1 = _mul32(tok, jnp.full_like(tok, m_lo))
    l2 = tok * m_hi  # low word of tok·m_hi; its high word only reaches bits ≥ 64
    return h1 + l2, l1


def _mod64(hi: Array, lo: Array, p: Array, digit_bits: int) -> Array:
    """`(hi·2^32 + lo) mod p`, uint32, every p < 2^(32 − digit_bits) (Horner over digits of lo)."""
    r = hi % p
    shift = 32
    while shift > 0:
        w = min(digit_bits, shift)
        shift -= w
        r = ((r << w) | ((lo >> shift) & np.uint32((1 << w) - 1))) % p
    return r


# ---------------------------------------------------------------------------------------------
# Hashing

def check_history(cfg: ModelConfig, history: np.ndarray) -> None:
    """Host-side check of concrete token ids before hashing: all in `[0, engram_compressed_vocab_size)`."""
    values = np.asarray(history)
    lo, hi = (int(values.min()), int(values.max())) if values.size else (0, 0)
    if lo < 0 or hi >= cfg.engram_compressed_vocab_size:
        raise ValueError(f"history: token ids span [{lo}, {hi}]; Engram hashes compressed ids in "
                         f"[0, engram_compressed_vocab_size={cfg.engram_compressed_vocab_size})")


def engram_hashes(cfg: ModelConfig, layer: int, history: Array) -> Array:
    """Row ids `[B, S, (N−1)·H]` int32 of the n-grams ending at each of the chunk's S positions.

    history [B, S + N − 1] integer: the N − 1 compressed token ids before the chunk (`engram_pad_id`
    before the sequence start) followed by the chunk's S tokens, all in `[0, engram_compressed_vocab_size)`
    (the caller's contract; `check_history` checks concrete ids on the host).
    """
    primes, offsets = engram_primes(cfg, layer), engram_offsets(cfg, layer)
    mults = [int(m) for m in engram_multipliers(cfg, layer)]
    N, H = cfg.engram_max_ngram_size, cfg.engram_n_heads
    history = jnp.asarray(history)
    if history.ndim != 2 or history.shape[1] < N:
        raise ValueError(f"history: shape {tuple(history.shape)}; expected [B, S + {N - 1}] with S ≥ 1 "
                         f"(the {N - 1} tokens before the chunk, then the chunk's tokens)")
    if not jnp.issubdtype(history.dtype, jnp.integer):
        raise ValueError(f"history: dtype {history.dtype}; expected integer token ids")
    S = history.shape[1] - (N - 1)
    tok = history.astype(jnp.uint32)
    digit_bits = 32 - max(primes).bit_length()
    columns = []
    hi = lo = None
    for i in range(N):  # look-back i: tok_{t−i} sits at history[:, N − 1 − i + t]
        t_hi, t_lo = _mul_tok(tok[:, N - 1 - i:N - 1 - i + S], mults[i])
        hi, lo = (t_hi, t_lo) if i == 0 else (hi ^ t_hi, lo ^ t_lo)
        if i == 0:
            continue
        n_primes = jnp.asarray(primes[(i - 1) * H:i * H], jnp.uint32)  # the (i+1)-gram's heads
        columns.append(_mod64(hi[..., None], lo[..., None], n_primes, digit_bits))
    rows = jnp.concatenate(columns, axis=-1).astype(jnp.int32)
    return rows + jnp.asarray(offsets, jnp.int32)


# ---------------------------------------------------------------------------------------------
# Parameters and the gated write

@dataclasses.dataclass(frozen=True)
class PackedRows:
    """The initializer (`csa2.params.Initializer`) of a packed table's `part` ("payload" or "scale"): the float
    table's `Normal(std)` draw of rows `[..., width]`, packed. Both parts draw the stream of the float table
    (`stream="table"`), so they pack one draw, and a packed model holds its float twin's table, packed."""

    std: float
    width: int
    part: str
    stream: str | None = "table"

    def __call__(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        rows = Normal(self.std)(rng, (*shape[:-1], self.width))
        return np.asarray(getattr(Stored.quantized(jnp.asarray(rows), WINDOW), self.part))


class EngramRows(nnx.Variable):
    """A packed table (`engram_table_format="fp8"`): e4m3 payload bits `[rows, hd]` or their UE8M0 scale bits
    `[rows, hd/32]`, uint8. Bits are not trained; train with the float table."""


class Engram(nnx.Module):
    """Layer `layer`'s n-gram memory (SPEC §10b): `table [Σ primes, hd]` (float32, or packed as released:
    `table` e4m3 bits + `table_scale` UE8M0 bits per 32 values, see `gather_rows`), `wkv [(N−1)·H·hd, (hc+1)·d]`
    (keys first), `q_weight`/`k_weight [hc, d]`."""

    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        hc, d, hd, std = cfg.hc_mult, cfg.hidden_size, cfg.engram_head_dim, cfg.initializer_range
        axes = ("engram_rows", "engram_dim")
        table = normal(rngs, (engram_table_rows(cfg, layer), hd), std, axes)
        if cfg.engram_table_format == "fp8":
            packed = Stored.quantized(table.get_value(), WINDOW)
            self.table = constant(packed.payload, axes, EngramRows, PackedRows(std, hd, "payload"))
            self.table_scale = constant(packed.scale, ("engram_rows", "engram_scales"), EngramRows,
                                        PackedRows(std, hd, "scale"))
        else:
            self.table = table
        self.wkv = normal(rngs, (n_tables(cfg) * hd, (hc + 1) * d), std, ("engram_in", "engram_out"), compute=True)
        self.q_weight = ones((hc, d), ("streams", "embed"))
        self.k_weight = ones((hc, d), ("streams", "embed"))


def gather_rows(params: dict, row_ids: Array) -> Array:
    """Table rows `row_ids [...]` as `[..., hd]` (float32 when packed): gathered, then (packed tables) dequantized, so
    only the gathered rows are ever decoded. A packed table is SPEC §8's `WINDOW` layout (e4m3, UE8M0 per 32)."""
    if "table_scale" not in params:
        return jnp.take(params["table"], row_ids, axis=0)
    packed = Stored(params["table"], params["table_scale"], WINDOW)
    return jax.tree.map(lambda a: jnp.take(a, row_ids, axis=0), packed).decode()


def engram_gate(a: Array) -> Array:
    """`σ(copysign(sqrt(max(|a|, 1e-6)), a))` (V4.1's signed square root before the sigmoid)."""
    a = a.astype(jnp.float32)
    return jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(a), GATE_CLAMP)), a))


def engram(cfg: ModelConfig, params: dict, X: Array, row_ids: Array, mask: Array | None = None) -> Array:
    """Add the gated n-gram value to each residual stream.

    X [B, S, hc_mult, hidden_size]; row_ids [B, S, (N−1)·H] from `engram_hashes`; mask [B, S] bool
    (optional, False leaves that position untouched). Returns X' with X's shape and dtype.
    """
    hc, d, hd, T = cfg.hc_mult, cfg.hidden_size, cfg.engram_head_dim, n_tables(cfg)
    X, row_ids = jnp.asarray(X), jnp.asarray(row_ids)
    if X.ndim != 4 or X.shape[2:] != (hc, d):
        raise ValueError(f"X: shape {tuple(X.shape)}; expected [B, S, hc_mult={hc}, hidden_size={d}]")
    if row_ids.shape != X.shape[:2] + (T,):
        raise ValueError(f"row_ids: shape {tuple(row_ids.shape)}; expected {X.shape[:2] + (T,)} "
                         f"([B, S] of X and (N−1)·heads = {T} columns from engram_hashes)")
    if not jnp.issubdtype(row_ids.dtype, jnp.integer):
        raise ValueError(f"row_ids: dtype {row_ids.dtype}; expected integer row ids")
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.shape != X.shape[:2]:
            raise ValueError(f"mask: shape {tuple(mask.shape)}; expected [B, S] = {X.shape[:2]}")
    table = params["table"]
    if table.ndim != 2 or table.shape[1] != hd:
        raise ValueError(f"params['table']: shape {tuple(table.shape)}; expected [rows, engram_head_dim={hd}]")
    if "table_scale" in params and params["table_scale"].shape != (table.shape[0], hd // WINDOW.block):
        raise ValueError(f"params['table_scale']: shape {tuple(params['table_scale'].shape)}; expected "
                         f"{(table.shape[0], hd // WINDOW.block)} (one UE8M0 scale per {WINDOW.block} values of a row)")
    if params["wkv"].shape != (T * hd, (hc + 1) * d):
        raise ValueError(f"params['wkv']: shape {tuple(params['wkv'].shape)}; expected {(T * hd, (hc + 1) * d)}")

    B, S = X.shape[:2]
    # [B, S, (hc+1)·d] float32
    kv = linear(gather_rows(params, row_ids).reshape(B, S, T * hd), params["wkv"], cfg.dtype)
    key = kv[..., :hc * d].reshape(B, S, hc, d)
    value = kv[..., hc * d:]
    h = X.astype(jnp.float32)
    q = rms_norm(h, params["q_weight"], cfg.rms_norm_eps)  # per (token, stream), over d
    k = rms_norm(key, params["k_weight"], cfg.rms_norm_eps)
    gate = engram_gate(jnp.sum(q * k, axis=-1) / math.sqrt(d))  # [B, S, hc]
    if mask is not None:
        gate = jnp.where(mask[..., None], gate, 0.0)
    return (h + gate[..., None] * value[:, :, None, :]).astype(X.dtype)
