"""CSA2 attention sublayer: hand cases, chunk invariance, causality, formats, shapes, bad input (SPEC §3–§6)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa2.attention as attn
from csa2.attention import grouped_output, window_ids
from csa2.boundary import check_chunk
from csa2.indexer import Bus
from csa2.layout import kv_address, layer_plan
from csa2.norm import rms_norm
from csa2.presets import preset
from csa2.stack import layer_kv
from csa2.state import init_state
from pallas_kernels import ops
from pallas_kernels.reference import sink_attention
from tests.csa2.attention_stack import context, init_stack, run_stack, stack_step
from tests.pallas_kernels.cases import ATTENTION_CASES, TOL, attention_case, np_sparse_attention

CFG = preset("mini")
T, CAP, B = 40, 64, 2  # 40 tokens wrap the 21-slot rings and cross many ratio-2 boundaries


@pytest.fixture(scope="module")
def params():
    return init_stack(CFG, jax.random.PRNGKey(0))


def _inputs(seed, t=T):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, t, CFG.hidden_size), jnp.float32)


def _vec(*v):
    return jnp.asarray(v, jnp.int32)


# ---------------------------------------------------------------- hand-computed cases

def test_sink_attention_single_entry_and_empty_row():
    q = jnp.zeros((1, 2, 1, 4)).at[0, :, 0, 0].set(2.0)
    keys = jnp.zeros((1, 2, 2, 4)).at[0, :, 0, :].set(jnp.array([1.0, 3.0, -1.0, 0.5]))
    valid = jnp.array([[[True, False], [False, False]]])
    sink = jnp.array([0.7])
    out = sink_attention(q, keys, valid, sink)
    logit = 2.0 * 1.0 * 4 ** -0.5
    expected = keys[0, 0, 0] * np.exp(logit) / (np.exp(logit) + np.exp(0.7))
    np.testing.assert_allclose(out[0, 0, 0], expected, rtol=1e-6)
    np.testing.assert_array_equal(out[0, 1], 0.0)  # no valid entry → 0, not NaN


def test_sink_attention_matches_softmax_with_extra_logit():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(k1, (1, 3, 2, 8))
    keys = jax.random.normal(k2, (1, 3, 5, 8))
    valid = jnp.ones((1, 3, 5), bool).at[0, 1, 2].set(False)
    sink = jax.random.normal(k3, (2,))
    out = sink_attention(q, keys, valid, sink)
    logits = jnp.einsum("bshd,bsed->bshe", q, keys) / np.sqrt(8)
    logits = jnp.where(valid[:, :, None], logits, -jnp.inf)
    full = jnp.concatenate([logits, jnp.broadcast_to(sink[None, None, :, None], (1, 3, 2, 1))], -1)
    probs = jax.nn.softmax(full, -1)[..., :-1]
    np.testing.assert_allclose(out, jnp.einsum("bshe,bsed->bshd", probs, keys), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ops.IMPLS)
def test_read_attention_per_head_is_each_head_over_its_own_set(impl):
    """Given one Global set per head `[B, S, H, K]` (an instrument's read), head h's output is the sparse attention
    of head h alone, with its sink, over its own set: checked against the numpy oracle of the kernel tests, head by
    head (a mutant that gave every head head 0's set, or another head's sink, fails); shared sets `[B, S, K]` are
    `ops.sparse_attention` itself."""
    args, _ = attention_case(7, **ATTENTION_CASES["chunk"])
    q, sink, main, main_idx, win, win_idx = args
    b, s, h, _ = q.shape
    rng = np.random.default_rng(1)
    per_head = rng.integers(-1, main.rows, (b, s, h, main_idx.shape[-1])).astype(np.int32)  # −1 anywhere
    cfg = CFG.replace(kernel_impl=impl)
    got = np.asarray(attn.read_attention(cfg, q, sink, main, jnp.asarray(per_head), win, win_idx))
    assert got.shape == q.shape
    for head in range(h):
        want = np_sparse_attention((np.asarray(q)[:, :, head:head + 1], np.asarray(sink)[head:head + 1], main,
                                    per_head[:, :, head], win, win_idx))
        np.testing.assert_allclose(got[:, :, head:head + 1], want, **TOL)
    shared = attn.read_attention(cfg, *args)
    np.testing.assert_array_equal(shared, ops.sparse_attention(*args, impl=impl))


def test_window_ids_ring_then_chunk():
    pos, ids = window_ids(_vec(10, 11)[None], _vec(10), window=4, slots=6)
    np.testing.assert_array_equal(pos[0], [[7, 8, 9, 10], [8, 9, 10, 11]])
    # 7, 8, 9 come from ring slots p % 6; 10, 11 are chunk rows 0, 1 after the 6 ring slots.
    np.testing.assert_array_equal(ids[0], [[1, 2, 3, 6], [2, 3, 6, 7]])


def test_inverse_rope_round_trips_own_value(params):
    """A query that only sees its own window entry returns that entry with RoPE undone (SPEC §3)."""
    cfg = CFG.replace(sliding_window=1)
    spec = layer_plan(cfg)[0]  # SWA layer
    p = dict(params[0], sink=jnp.full((cfg.num_attention_heads,), -1e30))
    state = init_state(cfg, 1, CAP, "float")
    x = _inputs(3, 5)[:1]
    ctx = context(state, _vec(7), _vec(5), quantize=False)
    kv = layer_kv(cfg, spec, state, jnp.int32(spec.index), None)  # layer 0's ring [B, slots, ·]
    out, *_ = attn.attention(cfg, spec, p, x, kv, Bus.empty(cfg, 1, 5), ctx, spec.index)
    own = rms_norm(x @ p["wkv"], p["kv_norm"], cfg.rms_norm_eps)  # un-rotated value
    heads = jnp.broadcast_to(own[:, :, None], (1, 5, cfg.num_attention_heads, cfg.head_dim))
    np.testing.assert_allclose(out, grouped_output(cfg, p, heads), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- chunk invariance

BUCKETS = (1, 8, T)


def _run_schedule(params, h, schedules, fmt="float", quantize=False):
    """Feed row b the chunk sizes schedules[b] (rows advance independently); return outputs [L, B, T, d], state."""
    state = init_state(CFG, B, CAP, fmt)
    outs = np.zeros((CFG.num_hidden_layers, B, T, CFG.hidden_size), np.float32)
    done, step = [0] * B, 0
    while any(d < T for d in done):
        sizes = [sch[step] if step < len(sch) else 0 for sch in schedules]
        s = next(b for b in BUCKETS if b >= max(sizes))
        chunk = np.zeros((B, s, CFG.hidden_size), np.float32)
        for b in range(B):
            chunk[b, :sizes[b]] = h[b, done[b]:done[b] + sizes[b]]
        o, state = run_stack(CFG, params, state, jnp.asarray(chunk), _vec(*done), _vec(*sizes), quantize=quantize)
        for b in range(B):
            outs[:, b, done[b]:done[b] + sizes[b]] = np.asarray(o[:, b, :sizes[b]])
            done[b] += sizes[b]
        step += 1
    return outs, state


def _random_sizes(rng, total=T, top=8):
    sizes = []
    while sum(sizes) < total:
        sizes.append(int(min(rng.integers(1, top + 1), total - sum(sizes))))
    return sizes


def _assert_same_state(a, b):
    np.testing.assert_array_equal(a.length, b.length)
    length = np.asarray(a.length)
    slots = a.swa.payload.shape[2]  # every layer's ring: [B, L, slots, D]
    for row in range(B):
        live = [p % slots for p in range(max(0, length[row] - CFG.sliding_window), length[row])]
        np.testing.assert_allclose(a.swa.payload[row][:, live], b.swa.payload[row][:, live], rtol=1e-5, atol=1e-5)
        for src in CFG.kv_source_layer_ids:
            k, slot = kv_address(CFG, src)  # Global KV [B, G, N, ·], tails [B, G, slots, D]
            r = CFG.compress_ratios[src]
            n = length[row] // r
            for part in ("kv", "ikey"):
                got, want = getattr(a.global_kv[k], part).payload, getattr(b.global_kv[k], part).payload
                np.testing.assert_allclose(got[row, slot, :n], want[row, slot, :n], rtol=1e-5, atol=1e-5)
            tail_slots = a.tails[k].kv.shape[2]
            tail = [p % tail_slots for p in range(r * n, length[row])] if tail_slots else []
            np.testing.assert_allclose(a.tails[k].kv[row, slot, tail], b.tails[k].kv[row, slot, tail],
                                       rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(a.tails[k].gate[row, slot, tail], b.tails[k].gate[row, slot, tail],
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_chunk_invariance(params, seed):
    """One chunk == random chunks (odd boundaries, rows out of step) == token by token (exact mode)."""
    h = np.asarray(_inputs(seed))
    rng = np.random.default_rng(seed)
    ref_out, ref_state = _run_schedule(params, h, [[T], [T]])
    for schedules in ([_random_sizes(rng), _random_sizes(rng)], [[1] * T, [3, 5] * 5]):
        out, state = _run_schedule(params, h, schedules)
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
        _assert_same_state(state, ref_state)


def test_chunk_invariance_with_fake_quant(params):
    """With FP4/FP8 fake-quant in the math, chunking still changes nothing beyond float noise."""
    h = np.asarray(_inputs(5))
    ref_out, ref_state = _run_schedule(params, h, [[T], [T]], quantize=True)
    out, state = _run_schedule(params, h, [[1] * T, _random_sizes(np.random.default_rng(5))], quantize=True)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    _assert_same_state(state, ref_state)


# ---------------------------------------------------------------- causality

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_causality(params, seed):
    """Perturbing tokens after t never changes any layer's output at positions ≤ t."""
    rng = np.random.default_rng(seed)
    h = np.asarray(_inputs(10 + seed))
    t = int(rng.integers(0, T - 1))
    h2 = h.copy()
    h2[:, t + 1:] += rng.normal(size=h2[:, t + 1:].shape).astype(np.float32) * 3
    state = init_state(CFG, B, CAP, "fp4")
    full = _vec(T, T)
    a, _ = run_stack(CFG, params, state, jnp.asarray(h), _vec(0, 0), full)
    b, _ = run_stack(CFG, params, state, jnp.asarray(h2), _vec(0, 0), full)
    np.testing.assert_array_equal(a[:, :, :t + 1], b[:, :, :t + 1])
    assert not np.allclose(a[:, :, t + 1:], b[:, :, t + 1:])


# ---------------------------------------------------------------- cache formats

def test_packed_cache_equals_float_cache_with_fake_quant(params):
    """FP4/FP8 packed storage and float storage of fake-quantized values give bitwise-equal outputs."""
    h = np.asarray(_inputs(7))
    sched = [[13, 1, 26], [7, 8, 25]]
    out_packed, s_packed = _run_schedule(params, h, sched, fmt="fp4", quantize=True)
    out_float, s_float = _run_schedule(params, h, sched, fmt="float", quantize=True)
    np.testing.assert_array_equal(out_packed, out_float)
    g = s_packed.global_kv[1]
    assert g.kv.packed and not s_float.global_kv[1].kv.packed
    np.testing.assert_array_equal(g.kv.decode(), s_float.global_kv[1].kv.payload)
    # every stored buffer: both stacks' Main KV and Indexer K, and every layer's ring
    for packed, flt in zip(s_packed.global_kv, s_float.global_kv):
        np.testing.assert_array_equal(packed.kv.decode(), flt.kv.payload)
        np.testing.assert_array_equal(packed.ikey.decode(), flt.ikey.payload)
    np.testing.assert_array_equal(s_packed.swa.decode(), s_float.swa.payload)


# ---------------------------------------------------------------- work bounds (shapes)

def test_decode_reads_window_plus_topk_and_reindex_scores_only_the_pool(params, monkeypatch):
    """Spies on the ops backends the layers dispatch to (`cfg.kernel_impl` = "xla"): the shapes of the
    entries each call reads, as [B, S, entries, D] (attention) and [B, N, Di] / [B, S, P, Di] (scores)."""
    seen = {"attention": [], "scores": []}
    backends = ops.BACKENDS
    real_attention = backends["sparse_attention"]["xla"]
    real_scores, real_gathered = backends["indexer_scores"]["xla"], backends["indexer_scores_gathered"]["xla"]

    def spy_attention(q, sink, main, main_idx, window, window_idx):
        assert main.dim == window.dim == q.shape[-1]
        assert main_idx.shape[:2] == window_idx.shape[:2] == q.shape[:2]
        # one softmax over the main_idx entries then the window_idx rows
        seen["attention"].append((*q.shape[:2], main_idx.shape[2] + window_idx.shape[2], main.dim))
        return real_attention(q, sink, main, main_idx, window, window_idx)

    def spy_scores(q, w, ikey, visible):  # scores every entry of the source's Indexer K [B, N, ·]
        seen["scores"].append((ikey.payload.shape[0], ikey.rows, ikey.dim))
        return real_scores(q, w, ikey, visible)

    def spy_gathered(q, w, ikey, ids, visible):  # gathers ids [B, S, P] of the Indexer K, then scores them
        seen["scores"].append((*ids.shape, ikey.dim))
        return real_gathered(q, w, ikey, ids, visible)

    monkeypatch.setitem(backends["sparse_attention"], "xla", spy_attention)
    monkeypatch.setitem(backends["indexer_scores"], "xla", spy_scores)
    monkeypatch.setitem(backends["indexer_scores_gathered"], "xla", spy_gathered)
    big = 256
    state = init_state(CFG, B, big, "fp4")
    jax.eval_shape(lambda s, x: stack_step(CFG, params, s, x, _vec(100, 200), _vec(1, 1)),
                   state, jnp.zeros((B, 1, CFG.hidden_size)))
    w, k, pool = CFG.sliding_window, CFG.index_topk, CFG.candidate_pool_size
    roles = [s.role for s in layer_plan(CFG)]
    expected = [(B, 1, w + (0 if r == "swa" else k), CFG.head_dim) for r in roles]
    assert seen["attention"] == expected
    # Full layers score all entries of their group; the Reindex layer (6) only its pool of positions.
    assert seen["scores"] == [(B, big // 2, CFG.index_head_dim), (B, big, CFG.index_head_dim),
                              (B, 1, pool, CFG.index_head_dim)]


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("bad, message", [
    (dict(tokens=jnp.zeros((B, 4, 7), jnp.int32)), "tokens.shape"),
    (dict(start=_vec(0, 0, 0)), "the state's batch"),  # the chunk's start is the state's length
    (dict(n_valid=_vec(5, 1)), "n_valid"),
    (dict(start=_vec(62, 0)), "beyond the state capacity"),
    (dict(tokens=jnp.zeros((B, CAP + 1), jnp.int32), n_valid=_vec(1, 1)), "exceeds the state capacity"),
    (dict(tokens=jnp.zeros((B, 4), jnp.float32)), "tokens.dtype"),
    (dict(n_valid=jnp.asarray([4.0, 4.0])), "n_valid"),
])
def test_check_chunk_rejects(bad, message):
    """`attention.validate_chunk` is now `boundary.check_chunk(cfg, state, tokens, n_valid)`: a chunk
    starts at the state's length."""
    args = dict(tokens=jnp.zeros((B, 4), jnp.int32), start=_vec(0, 0), n_valid=_vec(4, 4))
    args.update(bad)
    state = init_state(CFG, args["start"].shape[0], CAP, "float").replace(length=args["start"])
    with pytest.raises(ValueError, match=message):
        check_chunk(CFG, state, args["tokens"], args["n_valid"])
    check_chunk(CFG, init_state(CFG, B, CAP, "float"), jnp.zeros((B, 4), jnp.int32), _vec(4, 4))


def test_replay_floor_hides_older_window_entries(params):
    """With floor = chunk start, ring contents from before the chunk are never read (SPEC §11)."""
    x = _inputs(9, 6)
    state = init_state(CFG, B, CAP, "float")
    garbage = dataclasses.replace(state.swa, payload=jax.random.normal(jax.random.PRNGKey(4), state.swa.payload.shape))
    start = _vec(20, 33)
    outs = {}
    for name, swa in (("zeros", state.swa), ("garbage", garbage)):
        for floor in (start, _vec(0, 0)):
            o, _ = run_stack(CFG, params, state.replace(swa=swa), x, start, _vec(6, 6), floor, quantize=False)
            outs[name, int(floor[0])] = o
    layer0 = slice(0, 1)  # the SWA layer: its output depends on the window alone
    np.testing.assert_array_equal(outs["zeros", 20][layer0], outs["garbage", 20][layer0])
    assert not np.allclose(outs["zeros", 0][layer0], outs["garbage", 0][layer0])
