"""Tests for csa2.compressor (SPEC §4): pooling math, streaming over chunks, storage, commit."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from csa2 import quant
from csa2.compressor import Compressor, compress
from csa2.presets import preset
from csa2.rope import apply_rope, rope_frequencies
from csa2.state import init_state, tail_slots

CFG = preset("mini")  # KV sources: layer 1 (ratio 2), layer 4 (ratio 1); max_draft 4
D, DI, HIDDEN, ROPE = CFG.head_dim, CFG.index_head_dim, CFG.hidden_size, CFG.qk_rope_head_dim
CAPACITY = 32
# ratio -> (stack, slot) of that KV source in the state: mini stacks ((1,), (4,)), one source each
SOURCE = {2: (0, 0), 1: (1, 0)}
FREQS = rope_frequencies(ROPE, CFG.compress_rope_theta, CFG.rope_scaling)
LENGTHS = (23, 22, 17)  # tokens per row: rows end on odd / even boundaries
CHUNK = 32  # chunk slots of every multi-token call (one compile per ratio / format)


@functools.partial(jax.jit, static_argnums=(0, 2), static_argnames="quantize")
def _compress_stack(cfg, params, ratio, gkv, slot, tail, x, start, n_valid, *, quantize):
    """`compress` on source `slot` of a stacked GlobalKV (the SourceKV view is built inside the trace)."""
    source, tail = compress(cfg, params, ratio, gkv.source(slot), tail, x, start, n_valid, quantize=quantize)
    return source.stack(), tail


_decode = jax.jit(lambda store: store.decode())  # eager dispatch would compile op by op
_fake_quant = jax.jit(quant.fake_quant, static_argnums=1)


def _buffers(ratio, batch, cache_format="float"):
    """Empty (GlobalKV, CompressorTail) of the ratio-`ratio` source: its stack [B, 1, N, ·] (mini has one
    source per ratio) and its own tail [B, slots, D]."""
    state = init_state(CFG, batch, CAPACITY, cache_format)
    stack, slot = SOURCE[ratio]
    return state.global_kv[stack], jax.tree.map(lambda a: a[:, slot], state.tails[stack])


def _main(gkv):
    """The source's Main KV entries [B, N, D] (float storage)."""
    return gkv.kv.payload[:, 0]


def _ikey(gkv):
    return gkv.ikey.payload[:, 0]


def _params(ratio, seed):
    """Random weights with decisive gates and non-trivial norm weights."""
    p = nnx.to_pure_dict(nnx.state(Compressor(CFG, ratio, rngs=nnx.Rngs(seed))))
    rng = np.random.default_rng(seed)
    p["norm"] = jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.float32)
    p["ik_norm"] = jnp.asarray(rng.uniform(0.5, 1.5, DI), jnp.float32)
    if ratio > 1:
        p["wgate"] = p["wgate"] * 10.0
    return p


def _np_rope(v, pos):
    """Interleaved-pair rotation of the trailing ROPE channels by pos·FREQS, float64 (SPEC §7)."""
    f = FREQS.astype(np.float64)
    ang = np.asarray(pos, np.float64)[..., None] * f
    pairs = v[..., v.shape[-1] - ROPE:].reshape(*v.shape[:-1], ROPE // 2, 2)
    e, o = pairs[..., 0], pairs[..., 1]
    rot = np.stack([e * np.cos(ang) - o * np.sin(ang), e * np.sin(ang) + o * np.cos(ang)], -1)
    return np.concatenate([v[..., : v.shape[-1] - ROPE], rot.reshape(*v.shape[:-1], ROPE)], -1)


def _np_rms(v, w):
    """RMSNorm in float64 numpy."""
    return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + CFG.rms_norm_eps) * w


def _reference(params, ratio, x):
    """SPEC §4 in float64 numpy for one full sequence x [T, d]: (main, ikey) of every complete group."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x, np.float64)
    n = len(x) // ratio
    kv = (x @ p["wkv"])[: n * ratio].reshape(n, ratio, D)
    if ratio == 1:
        pooled = kv[:, 0]
    else:
        z = (x @ p["wgate"])[: n * ratio].reshape(n, ratio, D)
        w = np.exp(z - z.max(1, keepdims=True))
        pooled = (w / w.sum(1, keepdims=True) * kv).sum(1)
    latent = _np_rms(pooled, p["norm"])
    pos = ratio * np.arange(n)
    return _np_rope(latent, pos), _np_rope(_np_rms(latent @ p["wik"], p["ik_norm"]), pos)


def _run(params, ratio, bufs, x, schedule, *, quantize, chunk=CHUNK, start=None, garbage=None):
    """Feed rows of x [B, T, d] in chunks of `chunk` slots; schedule = n_valid per step, [steps, B].

    Padding slots hold zeros, or huge values from `garbage` (a numpy Generator). Checks that a
    row with n_valid = 0 leaves its Global KV and tail bit-identical.
    """
    gkv, tail = bufs
    length = np.zeros(x.shape[0], np.int32) if start is None else np.array(start, np.int32)
    for n in np.asarray(schedule, np.int32):
        buf = np.zeros((x.shape[0], chunk, HIDDEN), np.float32)
        if garbage is not None:
            buf = (1e30 * garbage.standard_normal(buf.shape)).astype(np.float32)
        for b in range(x.shape[0]):
            buf[b, : n[b]] = x[b, length[b]: length[b] + n[b]]
        before = jax.tree.map(_raw, (gkv, tail))
        gkv, tail = _compress_stack(CFG, params, ratio, gkv, 0, tail, jnp.asarray(buf), jnp.asarray(length),
                                    jnp.asarray(n), quantize=quantize)
        for old, new in zip(jax.tree.leaves(before), jax.tree.leaves((gkv, tail)), strict=True):
            np.testing.assert_array_equal(_raw(new)[n == 0], old[n == 0])
        length += n
    return gkv, tail


def _random_schedule(rng):
    """Per-step n_valid per row: 0, 1, odd sizes that straddle pairs, and 9 > the 6-slot tail."""
    left, steps = np.array(LENGTHS), []
    while left.any():
        n = np.minimum(rng.choice([0, 1, 1, 2, 3, 5, 9], len(left)), left)
        steps.append(n)
        left -= n
    return steps


def _sequences(seed):
    """Random inputs [3, max(LENGTHS), d] (rows beyond their length are unused)."""
    return np.random.default_rng(seed).standard_normal((len(LENGTHS), max(LENGTHS), HIDDEN)).astype(np.float32)


def _raw(a):
    """numpy view that compares float8 scales by their bytes (an e8m0 zero-init byte reads as NaN)."""
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _assert_same(got, want):
    """Equal up to float32 rounding: matmuls of different chunk shapes differ in the last ulps."""
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(_raw(b), _raw(a), rtol=1e-6, atol=3e-6)


def _assert_same_up_to_flips(got, want):
    """FP4 entries of two programs of different shapes (chunkings, stacks): their unquantized values differ in the
    last ulps, and re-rounded to FP4 a rare one lands a step apart (at a rounding midpoint, or in a block whose
    scale moves); anything else is equal to float rounding."""
    assert np.mean(np.abs(np.asarray(got) - np.asarray(want)) > 3e-6) < 0.005


def _entries(gkv):
    """Decoded (Main KV, Indexer K) of every entry of the source [B, N, ·], float32 numpy."""
    return np.asarray(_decode(gkv.kv))[:, 0], np.asarray(_decode(gkv.ikey))[:, 0]


# ------------------------------------------------------------------------------------ math


def test_pooling_hand_computed():
    # wkv reads channels 0..31 of x, wgate channels 32..63, wik is the identity.
    eye = np.eye(HIDDEN, dtype=np.float32)
    params = {"wkv": jnp.asarray(eye[:, :D]), "wgate": jnp.asarray(eye[:, D:]), "norm": jnp.ones(D),
              "wik": jnp.eye(D), "ik_norm": 2.0 * jnp.ones(DI)}
    even = np.arange(D) % 2 == 0
    x = np.zeros((3, 8, HIDDEN), np.float32)  # rows 1, 2 stay empty
    x[0, 0, :D] = 4.0  # group 0: kv = (4, 0); gate (ln 3, 0) on even channels, (0, 0) on odd ones
    x[0, 0, D:][even] = math.log(3.0)
    x[0, 3, :D] = 4.0  # group 1: kv = (0, 4); same gates → even 1/4·4 = 1, odd 2
    x[0, 2, D:][even] = math.log(3.0)
    x[0, 4, :D] = 7.0  # unpaired token: group 2 is incomplete
    gkv, tail = _run(params, 2, _buffers(2, 3), x, [[5, 0, 0]], quantize=False)

    latent = np.zeros((2, D))
    latent[0] = np.where(even, 3.0, 2.0) / math.sqrt(6.5 + CFG.rms_norm_eps)  # 3/4·4, 1/2·4
    latent[1] = np.where(even, 1.0, 2.0) / math.sqrt(2.5 + CFG.rms_norm_eps)
    main, ikey = np.asarray(_main(gkv)[0]), np.asarray(_ikey(gkv)[0])
    np.testing.assert_allclose(main[:2, : D - ROPE], latent[:, : D - ROPE], rtol=1e-6)  # rope-free part
    pos = np.array([0, 2])  # first position of each group
    np.testing.assert_allclose(apply_rope(main[:2], pos, FREQS, inverse=True), latent, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(main[:2], _np_rope(latent, pos), atol=1e-6)
    np.testing.assert_allclose(ikey[:2], _np_rope(2.0 * latent, pos), atol=2e-6)  # rms(latent) = 1
    assert not np.any(main[2:]) and not np.any(ikey[2:])
    slots = tail_slots(CFG, 2)
    np.testing.assert_array_equal(np.asarray(tail.kv[0, 4 % slots]), np.full(D, 7.0))


@pytest.mark.parametrize("ratio", [1, 2])
def test_matches_reference(ratio):
    params, x = _params(ratio, 0), _sequences(0)
    gkv, _ = _run(params, ratio, _buffers(ratio, 3), x, [LENGTHS], quantize=False)
    for b, length in enumerate(LENGTHS):
        main, ikey = _reference(params, ratio, x[b, :length])
        n = length // ratio
        np.testing.assert_allclose(_main(gkv)[b, :n], main, atol=1e-5)
        np.testing.assert_allclose(_ikey(gkv)[b, :n], ikey, atol=1e-5)
        assert not np.any(np.asarray(_main(gkv)[b, n:])) and not np.any(np.asarray(_ikey(gkv)[b, n:]))


def test_ratio1_entry_is_normed_projection():
    params, x = _params(1, 3), _sequences(3)
    gkv, _ = _run(params, 1, _buffers(1, 3), x, [[5, 0, 3]], quantize=False)
    latent = _np_rms(x[0, :5].astype(np.float64) @ np.asarray(params["wkv"], np.float64), np.asarray(params["norm"]))
    np.testing.assert_allclose(_main(gkv)[0, :5], _np_rope(latent, np.arange(5)), atol=1e-5)
    assert not np.any(np.asarray(_main(gkv)[1])) and not np.any(np.asarray(_main(gkv)[0, 5:]))


def test_init_params_shapes():
    p2, p1 = (nnx.to_pure_dict(nnx.state(Compressor(CFG, r, rngs=nnx.Rngs(0)))) for r in (2, 1))
    assert {k: v.shape for k, v in p2.items()} == {"wkv": (HIDDEN, D), "wgate": (HIDDEN, D), "norm": (D,),
                                                    "wik": (D, DI), "ik_norm": (DI,)}
    assert set(p1) == {"wkv", "norm", "wik", "ik_norm"}
    np.testing.assert_allclose(np.std(np.asarray(p2["wkv"])), CFG.initializer_range, rtol=0.1)


# ------------------------------------------------------------------------------- streaming


@pytest.mark.cross_shape
@pytest.mark.parametrize("ratio", [1, 2])
def test_chunk_invariance(ratio):
    """One chunk, token by token and random chunks write the same entries and tails (float format).

    Matmuls of different chunk shapes differ in the last float32 ulps, so unquantized values agree
    to a few ulps (≤ 3e-6 on unit-RMS entries). With quantize=True every run's entries are exactly
    the fake-quant of its own unquantized entries, and runs agree up to the rare FP4 rounding flips
    those ulps can cause.
    """
    for seed in range(3):
        params, x, rng = _params(ratio, seed), _sequences(seed), np.random.default_rng(seed)
        by_token = [np.minimum(1, np.maximum(np.array(LENGTHS) - t, 0)) for t in range(max(LENGTHS))]
        schedules = {"one": ([LENGTHS], CHUNK), "token": (by_token, 1), "random": (_random_schedule(rng), CHUNK)}
        runs = {(name, q): _run(params, ratio, _buffers(ratio, 3), x, steps, quantize=q, chunk=chunk)
                for name, (steps, chunk) in schedules.items() for q in (False, True)}
        for name in schedules:
            _assert_same(runs[name, False], runs["one", False])
            (gq, tq), (gf, tf) = runs[name, True], runs[name, False]
            np.testing.assert_array_equal(gq.kv.payload, _fake_quant(gf.kv.payload, quant.MAIN))
            np.testing.assert_array_equal(gq.ikey.payload, _fake_quant(gf.ikey.payload, quant.INDEX))
            _assert_same(tq, tf)
            for got, want in zip(_entries(gq), _entries(runs["one", True][0])):
                _assert_same_up_to_flips(got, want)


@pytest.mark.parametrize("ratio", [1, 2])
def test_incomplete_group_and_padding_never_written(ratio):
    params, x, rng = _params(ratio, 5), _sequences(5), np.random.default_rng(5)
    schedule = _random_schedule(rng)
    clean = _run(params, ratio, _buffers(ratio, 3), x, schedule, quantize=True)
    dirty = _run(params, ratio, _buffers(ratio, 3), x, schedule, quantize=True, garbage=rng)
    for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty), strict=True):
        np.testing.assert_array_equal(_raw(b), _raw(a))
    gkv, tail = clean
    for b, length in enumerate(LENGTHS):
        assert np.any(np.asarray(_main(gkv)[b, length // ratio - 1]))
        assert not np.any(np.asarray(_main(gkv)[b, length // ratio:])), "an incomplete group reached Global KV"
        assert not np.any(np.asarray(_ikey(gkv)[b, length // ratio:]))
        if ratio > 1:  # the tail holds the newest positions, keyed by position
            slots = tail_slots(CFG, ratio)
            pos = np.arange(length - slots, length)
            np.testing.assert_allclose(tail.kv[b, pos % slots], x[b, pos] @ np.asarray(params["wkv"]), atol=1e-5)
            np.testing.assert_allclose(tail.gate[b, pos % slots], x[b, pos] @ np.asarray(params["wgate"]), atol=1e-4)


@pytest.mark.parametrize("ratio", [1, 2])
def test_packed_decodes_to_quantized_float(ratio):
    params, x, rng = _params(ratio, 7), _sequences(7), np.random.default_rng(7)
    schedule = _random_schedule(rng)
    packed, ptail = _run(params, ratio, _buffers(ratio, 3, "fp4"), x, schedule, quantize=True)
    flt, ftail = _run(params, ratio, _buffers(ratio, 3), x, schedule, quantize=True)
    assert packed.kv.payload.dtype == jnp.uint8 and packed.kv.scale is not None and packed.kv.packed
    for got, want in zip(_entries(packed), _entries(flt)):
        for b, length in enumerate(LENGTHS):  # unwritten packed entries decode with the init scale
            np.testing.assert_array_equal(got[b, : length // ratio], want[b, : length // ratio])
    np.testing.assert_array_equal(np.asarray(ptail.kv), np.asarray(ftail.kv))
    init = _buffers(ratio, 3, "fp4")[0]  # entries past the last complete group keep their init bytes
    for got, want in zip(jax.tree.leaves(packed), jax.tree.leaves(init), strict=True):
        for b, length in enumerate(LENGTHS):  # leaves [B, 1, N, ·]: this stack's one source
            np.testing.assert_array_equal(_raw(got)[b, 0, length // ratio:], _raw(want)[b, 0, length // ratio:])


@pytest.mark.parametrize("prefix", [6, 7])
@pytest.mark.parametrize("ratio", [1, 2])
def test_commit_is_set_length(ratio, prefix):
    """A verify chunk of γ+1 tokens at L, committed to L+n+1, then continued, equals a clean run."""
    gamma, total = CFG.max_draft, 16
    rows = gamma + 1  # row n accepts n drafts
    params, rng = _params(ratio, 11), np.random.default_rng(11)
    x = rng.standard_normal((rows, total, HIDDEN)).astype(np.float32)
    clean = _run(params, ratio, _buffers(ratio, rows), x, [[total] * rows], quantize=True)

    state = _run(params, ratio, _buffers(ratio, rows), x, [[prefix] * rows], quantize=True)
    spec = x.copy()  # drafts after the accepted ones differ from the true continuation
    for n in range(rows):
        spec[n, prefix + n + 1: prefix + rows] = rng.standard_normal((gamma - n, HIDDEN))
    state = _run(params, ratio, state, spec, [[rows] * rows], quantize=True, start=[prefix] * rows)
    committed = prefix + 1 + np.arange(rows)
    final = _run(params, ratio, state, x, [total - committed], quantize=True, start=committed)
    _assert_same(final, clean)


# ------------------------------------------------------------------------------- bad input


def test_bad_shapes_raise():
    params = _params(2, 0)
    gkv, tail = _buffers(2, 2)
    x, start, n = jnp.zeros((2, 4, HIDDEN)), jnp.zeros((2,), jnp.int32), jnp.ones((2,), jnp.int32)
    cases = [
        ("x.shape", dict(x=jnp.zeros((2, HIDDEN)))),
        ("x.shape", dict(x=jnp.zeros((2, 4, HIDDEN + 1)))),
        ("start.shape", dict(start=jnp.zeros((3,), jnp.int32))),
        ("n_valid.shape", dict(n_valid=jnp.ones((2, 1), jnp.int32))),
        ("start.dtype", dict(start=jnp.zeros((2,), jnp.float32))),
        ("source.kv.payload.shape", dict(gkv=_buffers(2, 3)[0])),  # a Global KV of batch 3
        ("tail.kv.shape", dict(tail=_buffers(1, 2)[1])),
        ("ratio", dict(ratio=0)),
    ]
    for what, change in cases:
        args = dict(ratio=2, gkv=gkv, tail=tail, x=x, start=start, n_valid=n) | change
        with pytest.raises(ValueError, match=what.replace(".", r"\.")):
            compress(CFG, params, args["ratio"], args["gkv"].source(0), args["tail"], args["x"], args["start"],
                     args["n_valid"], quantize=False)
    with pytest.raises(ValueError, match="ratio"):
        Compressor(CFG, 0, rngs=nnx.Rngs(0))


@pytest.mark.cross_shape
@pytest.mark.parametrize("cache_format", ["float", "fp4"])
def test_writes_only_its_slot_of_a_stack(tiny, cache_format):
    """Source 1 of tiny's 3-source ratio-2 stack gets exactly the entries a lone source gets; sources 0 and 2
    (filled with other data) keep every bit; the slot may be traced."""
    assert (tiny.head_dim, tiny.index_head_dim, tiny.hidden_size) == (D, DI, HIDDEN)
    stack = init_state(tiny, 3, CAPACITY, cache_format).global_kv[0]
    assert stack.kv.payload.shape[1] == 3
    rng = np.random.default_rng(13)
    other = jax.tree.map(lambda a: jnp.asarray(rng.integers(1, 100, a.shape)).astype(a.dtype), stack)
    params, x = _params(2, 13), _sequences(13)
    tail = _buffers(2, 3)[1]
    buf = np.zeros((3, CHUNK, HIDDEN), np.float32)
    for b, length in enumerate(LENGTHS):
        buf[b, :length] = x[b, :length]
    args = (tail, jnp.asarray(buf), jnp.zeros(3, jnp.int32), jnp.asarray(LENGTHS, jnp.int32))
    lone, lone_tail = _compress_stack(CFG, params, 2, _buffers(2, 3, cache_format)[0], 0, *args, quantize=True)
    got, got_tail = _compress_stack(CFG, params, 2, other, jnp.int32(1), *args, quantize=True)
    for g, o in zip(jax.tree.leaves(got), jax.tree.leaves(other), strict=True):
        np.testing.assert_array_equal(_raw(g[:, 0]), _raw(o[:, 0]))
        np.testing.assert_array_equal(_raw(g[:, 2]), _raw(o[:, 2]))
        for b, length in enumerate(LENGTHS):  # beyond the written entries source 1 keeps its old bytes
            np.testing.assert_array_equal(_raw(g[b, 1, length // 2:]), _raw(o[b, 1, length // 2:]))
    # The written entries are the lone source's, computed by a program of other shapes (a 3-source stack, a traced
    # slot): equal to float rounding and the FP4 flips it can cause.
    for part in ("kv", "ikey"):
        mine, alone = np.asarray(_decode(getattr(got, part)))[:, 1], np.asarray(_decode(getattr(lone, part)))[:, 0]
        written = [(b, slice(0, length // 2)) for b, length in enumerate(LENGTHS)]
        _assert_same_up_to_flips(np.concatenate([mine[w] for w in written]),
                                 np.concatenate([alone[w] for w in written]))
    _assert_same(got_tail, lone_tail)
