"""Prefix hits (SPEC §11): encoder replay, the short-extend modes and the prefix store.

Prompts are fed in chunks of S columns through `infer.prefix_cache.prefill`, so every scenario shares the
same few compiled prefills (one per replay policy)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import model
from csa2.presets import preset
from csa2.replay import EXACT, Extend, ReplayPolicy
from csa2.state import init_state
from infer import prefix_cache as pc

MINI = preset("mini")  # W = 16, split 4 (a compressing ratio-1 source), 8 layers
CAP, S = 64, 16
PREFIX, PROMPT = 48, 52  # a short extend: 4 new tokens
ALL = ReplayPolicy(window=CAP, short_extend="borrow")  # R ≥ N


def _prompts(seed):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 256, PROMPT).astype(np.int32)
    return prompt[:PREFIX], prompt


def _serve(params, store, prompt, replay):
    return pc.prefill(MINI, params, store, [prompt], capacity=CAP, replay=replay, chunk=S, cache_format="float")


def _store(snapshots=1, **kw):
    return pc.PrefixCache(MINI, records=kw.pop("records", 4), snapshots=snapshots, block=kw.pop("block", S))


def _global(state, ratio_of_stack=(2, 1)):
    """Committed Global KV entries per stack, [G, length // ratio, D], row 0."""
    n = int(state.length[0])
    return [np.asarray(g.kv.payload[0, :, :n // r]) for g, r in zip(state.global_kv, ratio_of_stack)]


def _identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


# ------------------------------------------------------------------------------------ R ≥ N equivalence

@pytest.mark.parametrize("snapshots", [1, 0], ids=["snapshot", "encoder-replay"])
@pytest.mark.parametrize("replay", [ALL, EXACT], ids=["R>=N", "exact"])
def test_prefix_hit_with_a_window_covering_the_prompt_is_cold_exact_prefill(mini_params, replay, snapshots):
    """With R ≥ N a prefix hit equals the cold exact prefill of the whole prompt bit for bit (under the same chunk
    boundaries): with the snapshot the suffix continues the rings; without it the encoder replays the whole prefix
    (the decoder tail needs every position) and the cached Global KV it reads is what it would have written."""
    prefix, prompt = _prompts(0)
    store = _store(snapshots)
    _serve(mini_params, store, prefix, replay)
    logits, hit, info = _serve(mini_params, store, prompt, replay)
    cold, reference, _ = _serve(mini_params, _store(), prompt, EXACT)
    assert info["hits"].tolist() == [PREFIX] and info["snapshots"].tolist() == [bool(snapshots)]
    assert info["starts"].tolist() == [PREFIX if snapshots else 0]
    np.testing.assert_array_equal(logits, cold)
    _identical(hit, reference)


# ------------------------------------------------------------------------------------ the worked example

def test_spec_worked_example_hit_4096_prompt_4100(mini_params):
    """SPEC §11: hit 4096, prompt 4100, W = R = 128, no snapshot → the encoder replays [3968, 4096) then
    [4096, 4100); the decoder tail is [3972, 4100); Global grows by 4 decoder entries and 2 per ratio-2 encoder
    source, and no entry of the hit is rewritten. (The cached Global KV is synthetic: only positions matter.)"""
    cfg = dataclasses.replace(MINI, sliding_window=128)  # the window sizes rings, not parameters
    replay, hit, n = ReplayPolicy(window=128), 4096, 4100
    prompt = np.random.default_rng(1).integers(0, 256, n).astype(np.int32)
    extend = Extend.replaying(cfg, replay, jnp.array([hit]), jnp.array([n]))
    assert (int(extend.start[0]), int(extend.hit[0]), int(extend.end[0])) == (3968, 4096, 4100)

    state = init_state(cfg, 1, 4104, "float")
    cached = tuple(jax.tree.map(lambda a, r=r: jax.random.normal(jax.random.PRNGKey(r), a[0, :, :hit // r].shape), g)
                   for g, r in zip(state.global_kv, (2, 1)))
    record = pc.Record(tokens=prompt[:hit], global_kv=cached, config=pc.PrefixCache(cfg).config, cache_format="float")
    state, start = pc.PrefixCache(cfg).restore(pc.Hit(length=hit, record=record), state, 0, prompt, replay)
    assert start == 3968 and int(state.length[0]) == 3968
    tokens = jnp.asarray(prompt[None, start:])
    before = jax.tree.map(np.asarray, state.global_kv)
    _, after, aux = model.prefill(cfg, mini_params, state, tokens, replay=replay, extend=extend)

    assert int(after.length[0]) == 4100 and int(after.floor[0]) == 3972  # decoder tail [3972, 4100)
    split, layers = cfg.first_decoder_layer, cfg.num_hidden_layers  # the split layer compresses: all rows enter it
    assert int(aux["work"]) == (split + 1) * (n - start) + (layers - split - 1) * 128
    for g, r, old in zip(after.global_kv, (2, 1), before):
        new = np.asarray(g.kv.payload[0])
        np.testing.assert_array_equal(new[:, :hit // r], np.asarray(old.kv.payload[0, :, :hit // r]))  # read only
        grown = new[:, hit // r:n // r]
        assert grown.shape[1] == (4 if r == 1 else 2) and np.all(np.abs(grown).sum(-1) > 0)  # written
        assert not np.any(new[:, n // r:])  # nothing beyond the prompt


# ------------------------------------------------------------------------------------ snapshot vs replay

def test_snapshot_and_encoder_replay_agree_where_the_spec_says(mini_params):
    """Bounded replay (R = 8 < W = 16), a 4-token extend: the snapshot run continues the cached rings, the replay
    run rebuilds them from [32, 48). Both keep the hit's Global KV bit for bit, end at the same length and token
    history, and under "borrow" floor the decoder at the same N − R; the replayed rings are an approximation, so
    their new entries and logits differ (slightly)."""
    prefix, prompt = _prompts(2)
    replay = ReplayPolicy(window=8, short_extend="borrow")
    runs = {}
    for snapshots in (1, 0):
        store = _store(snapshots)
        _, cached, _ = _serve(mini_params, store, prefix, replay)
        logits, state, info = _serve(mini_params, store, prompt, replay)
        runs[snapshots] = (logits, state, info, cached)
    (ls, snap, i_s, cached), (lr, rep, i_r, _) = runs[1], runs[0]
    assert i_s["starts"].tolist() == [PREFIX] and i_r["starts"].tolist() == [PREFIX - MINI.sliding_window]
    for s in (snap, rep):
        for got, want in zip(_global(s), _global(cached)):
            np.testing.assert_array_equal(got[:, :want.shape[1]], want)
    np.testing.assert_array_equal(snap.length, rep.length)
    np.testing.assert_array_equal(snap.floor, [PROMPT - 8])
    np.testing.assert_array_equal(rep.floor, [PROMPT - 8])
    np.testing.assert_array_equal(snap.tokens, rep.tokens)
    assert 0 < float(jnp.abs(ls - lr).max()) < 1.0


def test_short_extend_modes_differ_only_in_the_decoder_window(mini_params):
    """A 4-token extend after a hit with its snapshot, R = 8: both modes run the same 4 decoder rows (same work);
    "truncate" floors their windows at the extend (48), "borrow" at N − R = 44 and reads the prefix's cached decoder
    ring entries of 44…47, so the logits differ."""
    prefix, prompt = _prompts(3)
    out = {}
    for mode in ("truncate", "borrow"):
        replay = ReplayPolicy(window=8, short_extend=mode)
        store = _store()
        _serve(mini_params, store, prefix, replay)
        out[mode] = _serve(mini_params, store, prompt, replay)
    (lt, st, it), (lb, sb, ib) = out["truncate"], out["borrow"]
    assert it["work"] == ib["work"] and int(st.floor[0]) == PREFIX and int(sb.floor[0]) == PROMPT - 8
    assert float(jnp.abs(lt - lb).max()) > 1e-3


# ------------------------------------------------------------------------------------ the store

def test_store_finds_block_prefixes_and_counts(mini_params):
    """Global KV is found at every block multiple of a stored prompt; the snapshot only at its exact length."""
    prefix, prompt = _prompts(4)
    store = _store()
    _serve(mini_params, store, prefix, ALL)  # 48 tokens: prefixes 16, 32, 48
    other = np.concatenate([prefix[:40], np.full(10, 7, np.int32)])
    hit = store.lookup(other)
    assert hit.length == 32 and hit.snapshot is None
    hit = store.lookup(prompt)
    assert hit.length == PREFIX and hit.snapshot is not None
    assert store.lookup(prefix).length == 32  # a prefix is shorter than the prompt
    assert store.lookup(np.full(20, 9, np.int32)).length == 0
    assert dict(store.stats) == {"inserts": 1, "lookups": 5, "misses": 2, "hits": 3, "snapshot_hits": 1,
                                 "hit_tokens": 32 + PREFIX + 32}
    assert store.nbytes["global_kv"] > 0 and store.nbytes["snapshots"] > 0


def test_store_evicts_least_recently_used_and_snapshots_first(mini_params):
    prompts = [np.full(S, k, np.int32) for k in range(3)]
    state = init_state(MINI, 3, CAP, "float")
    _, state, _ = model.prefill(MINI, mini_params, state, jnp.asarray(np.stack(prompts)), replay=ALL)
    store = pc.PrefixCache(MINI, records=2, snapshots=1, block=8)
    for b in range(3):
        if b == 2:
            store.lookup(np.append(prompts[0], 1))  # touch prompt 0: prompt 1 is now the oldest
        store.insert(prompts[b], state, b)
    assert store.lookup(np.append(prompts[1], 1)).length == 0  # evicted, with every block prefix it owned
    assert store.stats["evictions"] == 1 and store.stats["snapshot_evictions"] == 2
    assert store.lookup(np.append(prompts[0], 1)).length == S
    assert store.lookup(np.append(prompts[0], 1)).snapshot is None  # its snapshot went first
    assert store.lookup(np.append(prompts[2], 1)).snapshot is not None


def test_evicting_a_record_hands_its_shared_prefixes_to_another(mini_params):
    prompts = np.stack([np.r_[np.full(8, 1), np.full(8, k)] for k in (2, 3, 4)]).astype(np.int32)
    _, state, _ = model.prefill(MINI, mini_params, init_state(MINI, 3, CAP, "float"), jnp.asarray(prompts), replay=ALL)
    store = pc.PrefixCache(MINI, records=2, snapshots=0, block=8)
    for b in range(3):
        store.insert(prompts[b], state, b)  # the first record (the first owner of the shared 8) is evicted
    assert store.lookup(np.r_[prompts[0], 9]).length == 8
    assert store.lookup(np.r_[prompts[1], 9]).length == S


# ------------------------------------------------------------------------------------ bad input

def test_bad_prefix_hits_raise_clear_errors(mini_params):
    prefix, prompt = _prompts(5)
    store = _store()
    _serve(mini_params, store, prefix, ALL)
    hit = store.lookup(prompt)
    state = init_state(MINI, 1, CAP, "float")
    with pytest.raises(ValueError, match="hit.length=48 .* a prefix must be shorter than the prompt"):
        store.restore(hit, state, 0, prompt[:PREFIX], ALL)
    with pytest.raises(ValueError, match=r"extend.hit=\[60\].*prefix longer than the prompt"):
        model.prefill(MINI, mini_params, state, jnp.zeros((1, 4), jnp.int32),
                      extend=Extend(start=jnp.array([0]), end=jnp.array([52]), hit=jnp.array([60])))
    with pytest.raises(ValueError, match=r"replay fewer than min\(hit, sliding_window=16\).*Extend.replaying"):
        model.prefill(MINI, mini_params, state.replace(length=jnp.array([30], jnp.int32)), jnp.zeros((1, 4), jnp.int32),
                      extend=Extend(start=jnp.array([30]), end=jnp.array([52]), hit=jnp.array([40])))
    other = pc.PrefixCache(dataclasses.replace(MINI, sliding_window=32))
    with pytest.raises(ValueError, match="stored for config .* this store and state are for config"):
        other.restore(hit, init_state(other.cfg, 1, CAP, "float"), 0, prompt, ALL)
    with pytest.raises(ValueError, match="restore: the state does not have the shapes of this store's config"):
        other.restore(hit, state, 0, prompt, ALL)
    with pytest.raises(ValueError, match=r"insert: state.length\[0\]=0 but the prompt has 52 tokens"):
        store.insert(prompt, state, 0)
    with pytest.raises(ValueError, match="PrefixCache.snapshots=-1"):
        pc.PrefixCache(MINI, snapshots=-1)
