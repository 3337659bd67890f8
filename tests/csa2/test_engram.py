"""Tests for csa2.engram (SPEC §10b): exact hashing vs a big-integer reference, layout, gate, write."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from csa2 import engram as E, stack
from csa2.chunk import Chunk
from csa2.context import Context
from csa2.hooks import OWN_TOPK
from csa2.presets import preset
from pallas_kernels.formats import WINDOW
from pallas_kernels.stored import Stored

TINY = preset("tiny")
V41 = preset("v41_flash")
_hashes = jax.jit(E.engram_hashes, static_argnums=(0, 1))


def _engram_params(cfg, layer, key):
    """One Engram layer's parameters as a plain dict (the `Engram` module's state)."""
    return nnx.to_pure_dict(nnx.state(E.Engram(cfg, layer, rngs=nnx.Rngs(key))))


def _is_prime(n):
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


def _reference(cfg, layer, history, mults):
    """Plain Python ints: row ids [B, S, (N−1)·H] of every n-gram (exact, no wrap)."""
    N, H = cfg.engram_max_ngram_size, cfg.engram_n_heads
    primes, mults = E.engram_primes(cfg, layer), [int(m) for m in mults]
    offsets = [sum(primes[:c]) for c in range(len(primes))]
    B, S = len(history), len(history[0]) - (N - 1)
    out = np.zeros((B, S, len(primes)), np.int64)
    for b in range(B):
        for t in range(S):
            value = 0
            for i in range(N):
                product = int(history[b][N - 1 + t - i]) * mults[i]
                assert 0 <= product < 2**63  # what int64 holds without wrapping
                value ^= product
                if i:
                    for j in range(H):
                        c = (i - 1) * H + j
                        out[b, t, c] = value % primes[c] + offsets[c]
    return out


def _history(cfg, rng, batch, length):
    """Random compressed ids, with runs at the top of the vocabulary and at 0."""
    vc = cfg.engram_compressed_vocab_size
    h = rng.integers(0, vc, (batch, length))
    h[0, ::2] = vc - 1
    h[-1, :3] = [vc - 1, vc - 2, 0]
    return h


def _top_multipliers(cfg, layer):
    """Odd multipliers at the very top of the released range (products just below 2^63)."""
    bound = max(1, (2**63 - 1) // cfg.engram_compressed_vocab_size // 2)
    top = 2 * (bound - 1) + 1
    return np.array([top - 2 * k for k in range(cfg.engram_max_ngram_size)], np.int64)


# ---------------------------------------------------------------------------------------------
# Hashing

@pytest.mark.parametrize("cfg", [TINY, V41], ids=["tiny", "v41_flash"])
def test_hashes_match_bigint_reference(cfg):
    rng = np.random.default_rng(1)
    N = cfg.engram_max_ngram_size
    for layer in cfg.engram_layer_ids:
        history = _history(cfg, rng, 2, N - 1 + 6)
        got = np.asarray(_hashes(cfg, layer, jnp.asarray(history, jnp.int32)))
        assert got.dtype == np.int32 and got.shape == (2, 6, (N - 1) * cfg.engram_n_heads)
        np.testing.assert_array_equal(got, _reference(cfg, layer, history, E.engram_multipliers(cfg, layer)))


@pytest.mark.parametrize("cfg", [TINY, V41], ids=["tiny", "v41_flash"])
def test_hashes_exact_with_multipliers_at_top_of_range(cfg, monkeypatch):
    layer = cfg.engram_layer_ids[-1]
    mults = _top_multipliers(cfg, layer)
    monkeypatch.setattr(E, "engram_multipliers", lambda c, layer: mults)
    rng = np.random.default_rng(2)
    history = _history(cfg, rng, 2, cfg.engram_max_ngram_size - 1 + 4)
    history[1, :] = cfg.engram_compressed_vocab_size - 1  # every product is the largest one
    got = np.asarray(E.engram_hashes(cfg, layer, jnp.asarray(history, jnp.int32)))
    np.testing.assert_array_equal(got, _reference(cfg, layer, history, mults))


def test_uint32_pair_arithmetic_is_exact():
    rng = np.random.default_rng(3)
    a = np.concatenate([rng.integers(0, 2**32, 200, dtype=np.uint64), [0, 1, 2**32 - 1, 2**31]]).astype(np.uint32)
    b = np.concatenate([rng.integers(0, 2**32, 200, dtype=np.uint64),
                        [2**32 - 1, 0, 2**32 - 1, 2**31]]).astype(np.uint32)
    hi, lo = E._mul32(jnp.asarray(a), jnp.asarray(b))
    got = [(int(high) << 32) | int(low) for high, low in zip(np.asarray(hi), np.asarray(lo))]
    assert got == [int(x) * int(y) for x, y in zip(a, b)]
    # 64-bit mod for primes up to 2^31 − 1 (digit width 1) and small primes (wide digits).
    for p in (2**31 - 1, 16000057, 1009, 3):
        digit_bits = 32 - p.bit_length()
        v = [int(x) for x in rng.integers(0, 2**63, 100, dtype=np.int64)] + [2**63 - 1, 2**64 - 1, 0, p, p - 1]
        hi = jnp.asarray([x >> 32 for x in v], jnp.uint32)
        lo = jnp.asarray([x & 0xFFFFFFFF for x in v], jnp.uint32)
        r = E._mod64(hi, lo, jnp.uint32(p), digit_bits)
        assert [int(x) for x in np.asarray(r)] == [x % p for x in v]


def test_pad_id_before_sequence_start():
    cfg, layer = TINY, 1
    N, pad = cfg.engram_max_ngram_size, cfg.engram_pad_id
    tokens = np.array([[7, 200, 13], [0, 258, 5]])
    history = np.concatenate([np.full((2, N - 1), pad), tokens], axis=1)
    got = np.asarray(E.engram_hashes(cfg, layer, jnp.asarray(history, jnp.int32)))
    mults = [int(m) for m in E.engram_multipliers(cfg, layer)]
    primes, offsets = E.engram_primes(cfg, layer), E.engram_offsets(cfg, layer)
    for b in range(2):
        # position 0: the 2-gram is (pad, tok_0), the 3-gram (pad, pad, tok_0)
        two = tokens[b, 0] * mults[0] ^ pad * mults[1]
        three = two ^ pad * mults[2]
        H = cfg.engram_n_heads
        want = [two % primes[j] + offsets[j] for j in range(H)]
        want += [three % primes[H + j] + offsets[H + j] for j in range(H)]
        assert got[b, 0].tolist() == want
    # the pad really enters the hash: another filler changes position 0
    other = history.copy()
    other[:, : N - 1] = 3
    assert (np.asarray(E.engram_hashes(cfg, layer, jnp.asarray(other, jnp.int32)))[:, 0] != got[:, 0]).any()


def test_decode_and_prefill_hash_the_same_ngrams():
    cfg, layer = TINY, 14
    N, T = cfg.engram_max_ngram_size, 9
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, cfg.engram_compressed_vocab_size, (2, T))
    history = jnp.asarray(np.concatenate([np.full((2, N - 1), cfg.engram_pad_id), tokens], axis=1), jnp.int32)
    prefill = np.asarray(_hashes(cfg, layer, history))
    decode = np.concatenate([np.asarray(_hashes(cfg, layer, history[:, t:t + N])) for t in range(T)], axis=1)
    np.testing.assert_array_equal(prefill, decode)
    chunks = np.concatenate([np.asarray(_hashes(cfg, layer, history[:, 0:4 + N - 1])),
                             np.asarray(_hashes(cfg, layer, history[:, 4:T + N - 1]))], axis=1)
    np.testing.assert_array_equal(prefill, chunks)


# ---------------------------------------------------------------------------------------------
# Layout: primes and multipliers

@pytest.mark.parametrize("cfg", [TINY, V41, preset("mini")], ids=["tiny", "v41_flash", "mini"])
def test_primes(cfg):
    per_layer = [E.engram_primes(cfg, layer) for layer in cfg.engram_layer_ids]
    flat = [p for primes in per_layer for p in primes]
    n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    assert all(len(primes) == n_cols for primes in per_layer)
    assert all(_is_prime(p) and p > cfg.engram_vocab_size for p in flat)
    assert len(set(flat)) == len(flat)
    # search order: layers in engram_layer_ids order, then n, then head — consecutive primes ≥ V
    assert flat == sorted(flat)
    assert not [q for q in range(cfg.engram_vocab_size, flat[-1]) if q not in flat and _is_prime(q)]
    E._model_primes.cache_clear()
    assert [E.engram_primes(cfg, layer) for layer in cfg.engram_layer_ids] == per_layer
    if cfg is V41:
        assert flat[0] > 16_000_000
    offsets = E.engram_offsets(cfg, cfg.engram_layer_ids[0])
    assert offsets[0] == 0 and offsets[-1] + per_layer[0][-1] == E.engram_table_rows(cfg, cfg.engram_layer_ids[0])


@pytest.mark.parametrize("cfg", [TINY, V41], ids=["tiny", "v41_flash"])
def test_multipliers(cfg):
    bound = (2**63 - 1) // cfg.engram_compressed_vocab_size // 2
    rows = {}
    for layer in cfg.engram_layer_ids:
        m = E.engram_multipliers(cfg, layer)
        assert m.dtype == np.int64 and m.shape == (cfg.engram_max_ngram_size,)
        assert (m % 2 == 1).all() and (m >= 1).all() and (m <= 2 * (bound - 1) + 1).all()
        assert int(m.max()) * (cfg.engram_compressed_vocab_size - 1) < 2**63
        np.testing.assert_array_equal(m, E.engram_multipliers(cfg, layer))
        raw = np.random.default_rng(10007 * layer).integers(0, bound, size=(cfg.engram_max_ngram_size,), dtype=np.int64)
        np.testing.assert_array_equal(m, raw * 2 + 1)
        rows[layer] = m
    a, b = rows.values()
    assert (a != b).any()


# ---------------------------------------------------------------------------------------------
# Gate and gated write

def test_gate_hand_values():
    a = jnp.array([0.25, -0.25, 4.0, -4.0, 1e-9, -1e-9, 0.0, 1e-6])
    def sig(x):
        return 1 / (1 + math.exp(-x))

    want = [sig(0.5), sig(-0.5), sig(2.0), sig(-2.0), sig(1e-3), sig(-1e-3), sig(1e-3), sig(1e-3)]
    np.testing.assert_allclose(np.asarray(E.engram_gate(a)), want, rtol=1e-6)
    grads = jax.vmap(jax.grad(lambda x: E.engram_gate(x)))(jnp.array([0.0, 1e-12, -1e-12, 1e-7, -1e-7, 2e-6]))
    assert np.isfinite(np.asarray(grads)).all()


def _hand_cfg():
    return TINY.replace(hidden_size=4, hc_mult=2, engram_head_dim=2, engram_n_heads=1, engram_max_ngram_size=2,
                        rms_norm_eps=1e-12)


def test_update_hand_case():
    """One table, row [1, 0]: key_0 = +1, key_1 = −1 (all channels), value = [1, 2, 3, 4]."""
    cfg = _hand_cfg()
    params = _engram_params(cfg, 1, jax.random.PRNGKey(0))
    table = np.zeros(params["table"].shape, np.float32)
    table[5] = [1.0, 0.0]
    wkv = np.zeros((2, 12), np.float32)
    wkv[0, 0:4], wkv[0, 4:8], wkv[0, 8:12] = 1.0, -1.0, [1, 2, 3, 4]
    params = {**params, "table": jnp.asarray(table), "wkv": jnp.asarray(wkv)}
    X = jnp.asarray([[[[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]],
                      [[1.0, -1.0, 1.0, -1.0], [0.5, 0.5, 0.5, 0.5]]]])  # [1, 2, 2, 4]
    rows = jnp.full((1, 2, 1), 5, jnp.int32)
    out = np.asarray(E.engram(cfg, params, X, rows))
    def sig(x):
        return 1 / (1 + math.exp(-x))

    value = np.array([1.0, 2.0, 3.0, 4.0])
    # a = <unit-rms X_k, unit-rms key_k> / sqrt(4): ±4 / 2 = ±2; stream (1, 0) is orthogonal (a = 0)
    g = [[sig(math.sqrt(2)), sig(-math.sqrt(2))], [sig(1e-3), sig(-math.sqrt(2))]]
    want = np.asarray(X) + np.array(g)[None, :, :, None] * value
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    # norm weights scale a; the mask leaves a position untouched
    params2 = {**params, "q_weight": jnp.full((2, 4), 0.5), "k_weight": jnp.full((2, 4), 0.5)}
    out2 = np.asarray(E.engram(cfg, params2, X, rows, mask=jnp.array([[True, False]])))
    np.testing.assert_allclose(out2[0, 0, 0], np.asarray(X)[0, 0, 0] + sig(math.sqrt(0.5)) * value, rtol=1e-6)
    np.testing.assert_array_equal(out2[0, 1], np.asarray(X)[0, 1])


def test_init_and_jit_end_to_end():
    cfg, layer = TINY, 14
    params = _engram_params(cfg, layer, jax.random.PRNGKey(1))
    T, hd, d, hc = 4, cfg.engram_head_dim, cfg.hidden_size, cfg.hc_mult
    assert params["table"].shape == (sum(E.engram_primes(cfg, layer)), hd)
    assert params["wkv"].shape == (T * hd, (hc + 1) * d)
    assert params["q_weight"].shape == params["k_weight"].shape == (hc, d)
    rng = np.random.default_rng(5)
    history = jnp.asarray(rng.integers(0, cfg.engram_compressed_vocab_size, (2, 2 + 5)), jnp.int32)
    X = jnp.asarray(rng.normal(size=(2, 5, hc, d)), jnp.float32)

    def step(params, X, history):
        return E.engram(cfg, params, X, E.engram_hashes(cfg, layer, history))

    eager = step(params, X, history)
    jitted = jax.jit(step)(params, X, history)
    assert jitted.shape == X.shape and np.isfinite(np.asarray(jitted)).all()
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(jitted), np.asarray(X))
    grad = jax.jit(jax.grad(lambda p: jnp.sum(step(p, X, history) ** 2)))(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grad))


def test_bad_input_names_the_argument():
    cfg = TINY
    params = _engram_params(cfg, 1, jax.random.PRNGKey(0))
    hc, d = cfg.hc_mult, cfg.hidden_size
    X = jnp.zeros((1, 3, hc, d))
    rows = jnp.zeros((1, 3, 4), jnp.int32)
    with pytest.raises(ValueError, match="history"):
        E.engram_hashes(cfg, 1, jnp.zeros((1, 2), jnp.int32))  # needs ≥ N = 3 columns
    with pytest.raises(ValueError, match="history"):
        E.engram_hashes(cfg, 1, jnp.zeros((5,), jnp.int32))
    # token values are checked on the host, before hashing (engram_hashes checks shapes and dtypes only)
    with pytest.raises(ValueError, match="history"):
        E.check_history(cfg, np.full((1, 4), cfg.engram_compressed_vocab_size, np.int32))
    with pytest.raises(ValueError, match="history"):
        E.check_history(cfg, np.array([[0, 1, -1, 2]], np.int32))
    E.check_history(cfg, np.array([[0, 1, cfg.engram_compressed_vocab_size - 1, 2]], np.int32))  # in range: passes
    with pytest.raises(ValueError, match="history"):
        E.engram_hashes(cfg, 1, jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="layer"):
        E.engram_hashes(cfg, 2, jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="layer"):
        E.engram_primes(cfg, 0)
    with pytest.raises(ValueError, match="X"):
        E.engram(cfg, params, jnp.zeros((1, 3, hc + 1, d)), rows)
    with pytest.raises(ValueError, match="X"):
        E.engram(cfg, params, jnp.zeros((3, hc, d)), rows)
    with pytest.raises(ValueError, match="row_ids"):
        E.engram(cfg, params, X, jnp.zeros((1, 3, 5), jnp.int32))
    with pytest.raises(ValueError, match="row_ids"):
        E.engram(cfg, params, X, jnp.zeros((1, 2, 4), jnp.int32))
    with pytest.raises(ValueError, match="mask"):
        E.engram(cfg, params, X, rows, mask=jnp.ones((1, 2), bool))
    with pytest.raises(ValueError, match="wkv"):
        E.engram(cfg, {**params, "wkv": params["wkv"][:-1]}, X, rows)


def test_packed_table_gathers_then_decodes_the_same_rows_as_its_float_decoding(mini):
    """`engram_table_format="fp8"`: the layer's output equals the float layer's whose table is the packed table
    decoded whole (only the gathered rows are decoded)."""
    cfg = mini.replace(engram_head_dim=32, engram_table_format="fp8")
    layer = cfg.engram_layer_ids[0]
    packed = nnx.to_pure_dict(nnx.state(E.Engram(cfg, layer, nnx.Rngs(0))))
    assert packed["table"].dtype == jnp.uint8 and packed["table_scale"].shape == (packed["table"].shape[0], 1)
    dense = {k: v for k, v in packed.items() if k != "table_scale"}
    dense["table"] = Stored(packed["table"], packed["table_scale"], WINDOW).decode()
    rng = np.random.default_rng(0)
    X = jnp.asarray(rng.standard_normal((2, 5, cfg.hc_mult, cfg.hidden_size)), jnp.float32)
    ids = E.engram_hashes(cfg, layer, jnp.asarray(rng.integers(0, 259, (2, 5 + cfg.engram_max_ngram_size - 1))))
    np.testing.assert_array_equal(E.gather_rows(packed, ids), E.gather_rows(dense, ids))
    np.testing.assert_array_equal(E.engram(cfg, packed, X, ids), E.engram(cfg, dense, X, ids))
    with pytest.raises(ValueError, match=r"params\['table_scale'\]: shape \(3, 1\)"):
        E.engram(cfg, {**packed, "table_scale": packed["table_scale"][:3]}, X, ids)


def test_a_layer_body_applies_only_the_memory_of_its_own_layer():
    """A scanned body that covers Engram layers (`stack._engram`, one `lax.switch` on the traced layer index) adds
    layer 1's memory at layer 1 and layer 14's at layer 14, each hashed with its own constants, and nothing at any
    other layer."""
    cfg = TINY
    engrams = tuple((layer, _engram_params(cfg, layer, jax.random.PRNGKey(layer))) for layer in cfg.engram_layer_ids)
    rng = np.random.default_rng(7)
    b, s = 2, 5
    history = jnp.asarray(rng.integers(0, cfg.engram_compressed_vocab_size, (b, cfg.engram_max_ngram_size - 1 + s)),
                          jnp.int32)
    X = jnp.asarray(rng.normal(size=(b, s, cfg.hc_mult, cfg.hidden_size)), jnp.float32)
    n_valid = jnp.asarray([s, 3], jnp.int32)
    zeros = jnp.zeros((b,), jnp.int32)
    ctx = Context(chunk=Chunk(start=zeros, n_valid=n_valid, floor=zeros), history=history, rows=None,
                  written_from=None, quantize=False, instrument=OWN_TOPK, entries=0, split=cfg.first_decoder_layer,
                  decoder_floor=zeros)
    body = jax.jit(lambda X, index: stack._engram(cfg, engrams, X, ctx, index))
    valid = jnp.arange(s)[None] < n_valid[:, None]
    for index in (0, 1, 2, 14, 15, 39):
        want = X
        for layer, params in engrams:
            if layer == index:
                want = E.engram(cfg, params, X, E.engram_hashes(cfg, layer, history), valid)
        np.testing.assert_allclose(body(X, jnp.int32(index)), want, rtol=1e-6, atol=1e-6, err_msg=f"layer {index}")
    assert not np.allclose(body(X, jnp.int32(1)), body(X, jnp.int32(14)))
