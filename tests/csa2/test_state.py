"""Tests for csa2.state: shapes/dtypes of every leaf, byte accounting (SPEC §8), pytree behaviour, the stacked
Global KV views, bad input."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import model
from csa2.presets import preset
from csa2.state import (
    AcceptBuffer,
    CompressorTail,
    GlobalKV,
    SourceKV,
    State,
    abstract_state,
    init_state,
    kv_bytes_per_token,
    state_bytes,
    swa_bytes_per_sequence,
)
from pallas_kernels.formats import INDEX, MAIN, WINDOW
from pallas_kernels.stored import Stored

U8, I32, F32 = jnp.uint8, jnp.int32, jnp.float32
E4M3 = E8M0 = jnp.uint8  # packed buffers hold the bytes of e4m3 / ue8m0 values

# Hand-written geometry of each preset (not read from the code under test):
# layers, head_dim, index_head_dim, sliding_window, max_draft, engram history slots (n-1 + max_draft + 1),
# KV-source ratios in kv_source_layer_ids order, the Global KV stacks as (ratio, sources), engram pad id,
# DSpark draft stages.
GEOMETRY = {
    "v41_flash": dict(L=40, D=512, DI=128, W=128, draft=5, hist=3 + 5 + 1, ratios=(2, 2, 2, 1),
                      stacks=((2, 3), (1, 1)), pad=2, stages=3),
    "tiny": dict(L=40, D=32, DI=32, W=16, draft=5, hist=2 + 5 + 1, ratios=(2, 2, 2, 1), stacks=((2, 3), (1, 1)),
                 pad=258, stages=1),
    "mini": dict(L=8, D=32, DI=32, W=16, draft=5, hist=2 + 5 + 1, ratios=(2, 1), stacks=((2, 1), (1, 1)), pad=258,
                 stages=1),
}


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def expected_state(name, B, C, fmt):
    """The State every preset must produce, as ShapeDtypeStructs (None where the format has no scale)."""
    g = GEOMETRY[name]
    D, DI, L, slots = g["D"], g["DI"], g["L"], g["W"] + g["draft"]
    packed = fmt == "fp4"
    assert sum(n for _, n in g["stacks"]) == len(g["ratios"])
    global_kv, tails = [], []
    for r, G in g["stacks"]:  # same-ratio sources stacked: [B, G, N, ·]
        N = C // r
        global_kv.append(GlobalKV(
            kv=Stored(sds((B, G, N, D // 2), U8) if packed else sds((B, G, N, D), F32),
                      sds((B, G, N, D // 16), E4M3) if packed else None, MAIN),
            ikey=Stored(sds((B, G, N, DI // 2), U8) if packed else sds((B, G, N, DI), F32),
                        sds((B, G, N, DI // 32), E8M0) if packed else None, INDEX),
        ))
        t = r + g["draft"] if r > 1 else 0  # ratio-1 sources do not pool: empty tail
        tails.append(CompressorTail(kv=sds((B, G, t, D), F32), gate=sds((B, G, t, D), F32)))
    return State(
        length=sds((B,), I32),
        floor=sds((B,), I32),
        global_kv=tuple(global_kv),
        swa=Stored(sds((B, L, slots, D), E4M3 if packed else F32),  # every layer's ring, batch first
                   sds((B, L, slots, D // 32), E8M0) if packed else None, WINDOW),
        tails=tuple(tails),
        tokens=sds((B, g["hist"]), I32),
        accept=AcceptBuffer(tokens=sds((B, g["draft"] + 1), I32), count=sds((B,), I32), width=sds((B,), I32)),
        # one context window per draft stage, one slot more than a backbone ring (it ends at length − 1)
        draft=Stored(sds((B, g["stages"], slots + 1, D), E4M3 if packed else F32),
                     sds((B, g["stages"], slots + 1, D // 32), E8M0) if packed else None, WINDOW),
    )


def assert_matches(state, expected):
    assert type(state) is State
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(expected)
    got = jax.tree_util.tree_flatten_with_path(state)[0]
    want = jax.tree_util.tree_leaves(expected)
    assert len(got) == len(want)
    for (path, leaf), exp in zip(got, want):
        where = jax.tree_util.keystr(path)
        assert leaf.shape == exp.shape, (where, leaf.shape, exp.shape)
        assert jnp.dtype(leaf.dtype) == exp.dtype, (where, leaf.dtype, exp.dtype)
        chex.assert_shape(leaf, exp.shape)
        chex.assert_type(leaf, exp.dtype)


def nbytes(tree):
    """Independent byte count: numpy nbytes of concrete leaves, or prod(shape)·itemsize of abstract ones."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.ShapeDtypeStruct):
            total += int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
        else:
            total += np.asarray(x).nbytes
    return total


# --------------------------------------------------------------------------------------------
# Shapes and dtypes


@pytest.mark.parametrize("fmt", ["fp4", "float"])
@pytest.mark.parametrize("name,B,C", [("tiny", 2, 64), ("tiny", 1, 256), ("mini", 3, 32)])
def test_init_state_leaves(name, B, C, fmt):
    cfg = preset(name)
    state = init_state(cfg, B, C, fmt)
    assert_matches(state, expected_state(name, B, C, fmt))
    if fmt == "float":
        assert all(g.kv.scale is None and g.ikey.scale is None for g in state.global_kv)
        assert state.swa.scale is None
    else:
        assert all(g.kv.packed and g.ikey.packed for g in state.global_kv) and state.swa.packed
    # initial contents
    np.testing.assert_array_equal(state.length, np.zeros(B, np.int32))
    np.testing.assert_array_equal(state.tokens, np.full((B, GEOMETRY[name]["hist"]), GEOMETRY[name]["pad"]))
    assert GEOMETRY[name]["pad"] == cfg.engram_pad_id
    np.testing.assert_array_equal(state.accept.tokens, 0)
    np.testing.assert_array_equal(state.accept.count, 0)
    np.testing.assert_array_equal(state.accept.width, 0)
    for t in state.tails:
        np.testing.assert_array_equal(t.kv, 0)
        np.testing.assert_array_equal(t.gate, 0)
    for g in state.global_kv:
        np.testing.assert_array_equal(np.asarray(g.kv.payload, np.float32), 0)
        np.testing.assert_array_equal(np.asarray(g.ikey.payload, np.float32), 0)
        np.testing.assert_array_equal(g.kv.decode(), 0)  # empty entries decode to zeros in either format
        np.testing.assert_array_equal(g.ikey.decode(), 0)
    np.testing.assert_array_equal(state.swa.decode(), 0)
    assert state.batch == B


@pytest.mark.parametrize("fmt", ["fp4", "float"])
@pytest.mark.parametrize("name,B,C", [("tiny", 2, 64), ("mini", 3, 32), ("v41_flash", 1, 2**20),
                                      ("v41_flash", 4, 8192)])
def test_abstract_state_leaves(name, B, C, fmt):
    state = abstract_state(preset(name), B, C, fmt)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(state))
    assert_matches(state, expected_state(name, B, C, fmt))


@pytest.mark.parametrize("fmt", ["fp4", "float"])
def test_abstract_state_agrees_with_init_state(mini, fmt):
    cfg = mini
    chex.assert_trees_all_equal_shapes_and_dtypes(init_state(cfg, 2, 16, fmt), abstract_state(cfg, 2, 16, fmt))


def test_capacity_granule_is_the_lcm_of_ratios(tiny):
    """Ratios 2 and 3: capacity must be a multiple of 6, not just of the largest or first ratio."""
    cfg = tiny.replace(compress_ratios=(0, 0) + (2,) * 6 + (3,) * 12 + (1,) * 20)
    for bad in (2, 3, 4, 8, 9):
        with pytest.raises(ValueError, match=f"capacity={bad}"):
            abstract_state(cfg, 1, bad)
    state = abstract_state(cfg, 1, 12)
    # KV sources 2, 8, 14, 20 have ratios 2, 3, 3, 1: stacks (2,), (8, 14), (20,), each [B, G, N, ·].
    assert [g.kv.payload.shape[1:3] for g in state.global_kv] == [(1, 6), (2, 4), (1, 12)]
    per_source = [g.kv.payload.shape[2] for g in state.global_kv for _ in range(g.kv.payload.shape[1])]
    assert per_source == [6, 4, 4, 12]
    assert [t.kv.shape[1] for t in state.tails] == [1, 2, 1]
    per_source = [t.kv.shape[2] for t in state.tails for _ in range(t.kv.shape[1])]
    assert per_source == [2 + 5, 3 + 5, 3 + 5, 0]  # ratio + max_draft; ratio 1: none


# --------------------------------------------------------------------------------------------
# Bytes (SPEC §8)


def test_kv_bytes_per_token_v41_flash(v41_flash):
    # (3 sources × ½ + 1 source) × (Main 256+32 + Indexer K 64+4)
    assert kv_bytes_per_token(v41_flash) == 890.0
    assert kv_bytes_per_token(v41_flash, "fp4") == (3 * 0.5 + 1) * ((256 + 32) + (64 + 4))
    # float: 4 bytes × (512 + 128) per entry
    assert kv_bytes_per_token(v41_flash, "float") == 2.5 * 4 * (512 + 128) == 6400.0


def test_kv_bytes_per_token_tiny_and_mini(mini, tiny):
    # tiny: head_dim 32 → 16 B FP4 + 2 e4m3 scales; index_head_dim 32 → 16 B + 1 ue8m0 scale: 35 B/entry.
    entry = (32 // 2 + 32 // 16) + (32 // 2 + 32 // 32)
    assert entry == 35
    assert kv_bytes_per_token(tiny) == 2.5 * 35 == 87.5
    assert kv_bytes_per_token(tiny, "float") == 2.5 * 4 * 64 == 640.0
    assert kv_bytes_per_token(mini) == (0.5 + 1) * 35 == 52.5
    assert kv_bytes_per_token(mini, "float") == 1.5 * 256 == 384.0


def test_swa_bytes_per_sequence(mini, tiny, v41_flash):
    assert swa_bytes_per_sequence(v41_flash) == 40 * 128 * 528 == 2_703_360
    assert swa_bytes_per_sequence(v41_flash, "float") == 40 * 128 * 512 * 4
    assert swa_bytes_per_sequence(tiny) == 40 * 16 * (32 + 1)
    assert swa_bytes_per_sequence(mini) == 8 * 16 * (32 + 1)


@pytest.mark.parametrize("fn", [kv_bytes_per_token, swa_bytes_per_sequence])
def test_bytes_reject_unknown_format(tiny, fn):
    with pytest.raises(ValueError, match="cache_format='fp8'"):
        fn(tiny, "fp8")


def test_v41_flash_global_kv_at_1m_is_exact(v41_flash):
    """890 B/token × 2^20 tokens: 3 ratio-2 sources × 2^19 entries + 1 ratio-1 source × 2^20 entries,
    each 356 B, = 2.5 × 2^20 × 356 = 933,232,640 B. Integer arithmetic, so exactly equal."""
    parts = state_bytes(abstract_state(v41_flash, 1, 2**20))
    assert parts["global_kv"] == 890 * 2**20 == 933_232_640
    assert parts["global_kv"] == (3 * 2**19 + 2**20) * 356
    # the rest of the state, by hand
    assert parts["swa"] == 40 * 1 * (128 + 5) * 528
    assert parts["tails"] == 3 * 2 * (1 * (2 + 5) * 512 * 4)  # ratio-1 source: empty tail
    assert parts["tokens"] == 1 * (3 + 5 + 1) * 4  # n − 1 + max_draft + 1 history slots
    assert parts["accept"] == 1 * 6 * 4 + 2 * 1 * 4  # tokens [1, max_draft + 1], count, width
    assert parts["length"] == 4
    assert parts["floor"] == 4
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")


@pytest.mark.parametrize("fmt", ["fp4", "float"])
@pytest.mark.parametrize("name,cap", [("tiny", 64), ("mini", 32), ("v41_flash", 2**20), ("v41_flash", 4096)])
def test_global_kv_bytes_match_per_token_figure(name, cap, fmt):
    cfg = preset(name)
    for batch in (1, 3):
        parts = state_bytes(abstract_state(cfg, batch, cap, fmt))
        assert parts["global_kv"] == batch * cap * kv_bytes_per_token(cfg, fmt)


@pytest.mark.parametrize("fmt", ["fp4", "float"])
@pytest.mark.parametrize("name,B,C", [("tiny", 2, 64), ("mini", 3, 32)])
def test_state_bytes_is_sum_of_leaf_nbytes(name, B, C, fmt):
    state = init_state(preset(name), B, C, fmt)
    parts = state_bytes(state)
    assert parts["global_kv"] == nbytes(state.global_kv)
    assert parts["swa"] == nbytes(state.swa)
    assert parts["tails"] == nbytes(state.tails)
    assert parts["tokens"] == nbytes(state.tokens)
    assert parts["accept"] == nbytes(state.accept)
    assert parts["length"] == nbytes(state.length)
    assert parts["total"] == nbytes(state)
    assert state_bytes(abstract_state(preset(name), B, C, fmt)) == parts


def test_state_bytes_abstract_v41_flash_total(v41_flash):
    state = abstract_state(v41_flash, 2, 2**16, "float")
    assert state_bytes(state)["total"] == nbytes(state)


# --------------------------------------------------------------------------------------------
# Pytree behaviour


@pytest.fixture(params=["fp4", "float"])
def tiny_state(tiny, request):
    return init_state(tiny, 2, 32, request.param)


def test_state_is_a_pytree(tiny_state):
    doubled = jax.tree_util.tree_map(lambda x: jnp.zeros_like(x), tiny_state)
    assert type(doubled) is State and type(doubled.swa) is Stored and type(doubled.global_kv[0]) is GlobalKV
    assert type(doubled.global_kv[0].kv) is Stored and doubled.global_kv[0].kv.fmt == MAIN
    assert jax.tree_util.tree_structure(doubled) == jax.tree_util.tree_structure(tiny_state)
    ones = jax.tree_util.tree_map(lambda x: x + 1, tiny_state.replace(swa=None, global_kv=()))
    np.testing.assert_array_equal(ones.length, 1)


def test_state_is_frozen(tiny_state):
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_state.length = jnp.ones(2, jnp.int32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_state.swa.payload = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_state.global_kv[0].kv = None
    # updates go through replace, which returns a new value
    new = tiny_state.replace(length=jnp.full((2,), 5, jnp.int32))
    np.testing.assert_array_equal(tiny_state.length, 0)
    np.testing.assert_array_equal(new.length, 5)


def test_state_passes_through_jit(tiny_state):
    out = jax.jit(lambda s: s)(tiny_state)
    assert type(out) is State
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tiny_state)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, tiny_state)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(tiny_state)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))

    bumped = jax.jit(lambda s: s.replace(length=s.length + 3))(tiny_state)
    np.testing.assert_array_equal(bumped.length, 3)
    chex.assert_trees_all_equal_shapes_and_dtypes(bumped, tiny_state)


def test_abstract_state_allocates_nothing_at_1m(v41_flash):
    state = abstract_state(v41_flash, 8, 2**20)
    assert state.global_kv[1].kv.payload.shape == (8, 1, 2**20, 256)  # the decoder's ratio-1 source
    assert state.global_kv[0].kv.payload.shape == (8, 3, 2**19, 256)  # the encoder's 3 ratio-2 sources
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(state))


@pytest.mark.parametrize("name,B,C,make", [("tiny", 3, 64, init_state), ("mini", 5, 32, init_state),
                                            ("v41_flash", 5, 2**20, abstract_state)])
@pytest.mark.parametrize("fmt", ["fp4", "float"])
def test_every_leaf_is_batch_first(name, B, C, make, fmt):
    """Batch is axis 0 of every leaf (Global KV, rings, tails, history, accept), so `fork` is one tree map."""
    state = make(preset(name), B, C, fmt)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    # length, floor; 2 stacks × (kv, ikey) payloads [+ scales]; swa [+ scale]; 2 tails × (kv, gate); tokens;
    # accept (tokens, count, width); draft [+ scale]
    stored = 2 if fmt == "fp4" else 1
    assert len(leaves) == 2 + 2 * 2 * stored + stored + 2 * 2 + 1 + 3 + stored
    for path, leaf in leaves:
        assert leaf.ndim >= 1 and leaf.shape[0] == B, (jax.tree_util.keystr(path), leaf.shape)


def _mark_rows(state):
    """Row b of every leaf set to 2**b: exact in every leaf dtype (uint8, int32, f32, e4m3, ue8m0)."""
    def fill(a):
        v = (2.0 ** jnp.arange(a.shape[0], dtype=jnp.float32)).reshape((-1,) + (1,) * (a.ndim - 1))
        return jnp.broadcast_to(v, a.shape).astype(a.dtype)
    return jax.tree.map(fill, state)


@pytest.mark.parametrize("fmt", ["fp4", "float"])
def test_fork_gathers_rows_of_every_leaf(tiny, fmt):
    state = _mark_rows(init_state(tiny, 3, 32, fmt))
    rows = jnp.asarray([2, 0, 0, 1], jnp.int32)
    forked = model.fork(state, rows)
    assert type(forked) is State and forked.batch == 4
    assert jax.tree_util.tree_structure(forked) == jax.tree_util.tree_structure(state)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(forked)[0], jax.tree_util.tree_leaves(state)):
        where = jax.tree_util.keystr(path)
        assert got.shape == (4,) + want.shape[1:] and got.dtype == want.dtype, where
        expected = np.broadcast_to((2.0 ** np.asarray(rows)).reshape((-1,) + (1,) * (got.ndim - 1)), got.shape)
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), expected, err_msg=where)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _stacked(packed, b=2, g=3, n=4, seed=0):
    """A hand-made 3-source stack [B, G, N, ·] of random entries (MAIN D = 32, INDEX Di = 32)."""
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((b, g, n, 32)).astype(np.float32)
    ik = rng.standard_normal((b, g, n, 32)).astype(np.float32)
    return GlobalKV(kv=_store(kv, MAIN, packed), ikey=_store(ik, INDEX, packed))


def _store(x, fmt, packed):
    return Stored.quantized(jnp.asarray(x), fmt) if packed else Stored(jnp.asarray(x), None, fmt)


@pytest.mark.parametrize("packed", [False, True])
def test_global_kv_source_view(packed):
    gkv = _stacked(packed)
    B, G, N = 2, 3, 4
    src = gkv.source(1)
    assert isinstance(src, SourceKV)
    assert int(src.offset) == 1 * N and src.entries == N and src.sources == G
    assert src.kv.payload.shape[:2] == (B, G * N) and src.ikey.payload.shape[:2] == (B, G * N)
    assert src.kv.fmt == MAIN and src.ikey.fmt == INDEX and src.kv.packed == packed
    # entry ids → rows of the flat [B, G·N] buffers; −1 stays −1
    ids = jnp.asarray([[0, 3, -1], [2, -1, 1]], jnp.int32)
    np.testing.assert_array_equal(src.rows(ids), [[4, 7, -1], [6, -1, 5]])
    np.testing.assert_array_equal(gkv.source(2).rows(ids), [[8, 11, -1], [10, -1, 9]])
    # the flat rows are the source's entries: gather through `rows` reads source 1
    np.testing.assert_array_equal(src.kv.gather(src.rows(jnp.asarray([[0, 3], [1, 2]]))),
                                  np.stack([gkv.kv.decode()[0, 1, [0, 3]], gkv.kv.decode()[1, 1, [1, 2]]]))
    # ikeys(): that source's Indexer K [B, N, ·]
    own = src.ikeys()
    assert own.fmt == INDEX and own.rows == N and own.payload.shape[:2] == (B, N)
    for got, want in zip(jax.tree.leaves(own), jax.tree.leaves(gkv.ikey), strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want[:, 1]))
    np.testing.assert_array_equal(own.decode(), gkv.ikey.decode()[:, 1])
    # a single-source stack: slot 0 has offset 0, so rows are the entry ids
    single = GlobalKV(kv=jax.tree.map(lambda a: a[:, 2:], gkv.kv), ikey=jax.tree.map(lambda a: a[:, 2:], gkv.ikey))
    assert int(single.source(0).offset) == 0
    np.testing.assert_array_equal(single.source(0).rows(ids), ids)


@pytest.mark.parametrize("packed", [False, True])
def test_global_kv_source_write_and_stack(packed):
    """Writing source 1 of a 3-source stack changes exactly the valid entries of source 1; `.stack()`
    gives the [B, G, N, ·] buffers back; a view with no write round-trips bit for bit."""
    gkv = _stacked(packed)
    for slot in range(3):
        back = gkv.source(slot).stack()
        assert type(back) is GlobalKV
        assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(gkv)
        for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(gkv), strict=True):
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(_bits(got), _bits(want))

    rng = np.random.default_rng(1)
    new_kv = _store(10 + rng.standard_normal((2, 2, 32)).astype(np.float32), MAIN, packed)
    new_ik = _store(10 + rng.standard_normal((2, 2, 32)).astype(np.float32), INDEX, packed)
    entry = jnp.asarray([[1, 2], [0, 3]], jnp.int32)
    valid = jnp.asarray([[True, False], [True, True]])
    eager = gkv.source(1).write(entry, new_kv, new_ik, valid).stack()
    traced = jax.jit(lambda g, s: g.source(s).write(entry, new_kv, new_ik, valid).stack())(gkv, jnp.int32(1))
    written = {(0, 1): (0, 0), (1, 0): (1, 0), (1, 3): (1, 1)}  # (row, entry) of source 1 ← (row, j) of the write
    for out in (eager, traced):
        for part, new in (("kv", new_kv), ("ikey", new_ik)):
            got_store, old_store = getattr(out, part), getattr(gkv, part)
            for got, old, val in zip(jax.tree.leaves(got_store), jax.tree.leaves(old_store), jax.tree.leaves(new),
                                     strict=True):
                got, old, val = _bits(got), _bits(old), _bits(val)
                np.testing.assert_array_equal(got[:, 0], old[:, 0])  # sources 0 and 2: untouched
                np.testing.assert_array_equal(got[:, 2], old[:, 2])
                for row in range(2):
                    for e in range(4):
                        want = val[written[row, e]] if (row, e) in written else old[row, 1, e]
                        np.testing.assert_array_equal(got[row, 1, e], want, err_msg=f"{part} row {row} entry {e}")
            np.testing.assert_array_equal(got_store.decode()[0, 1, 1], new.decode()[0, 0])
    # entries in another format or storage are refused
    with pytest.raises(ValueError, match="format"):
        gkv.source(1).write(entry, new_ik, new_ik, valid)


@pytest.mark.parametrize("packed", [False, True])
def test_global_kv_source_write_outside_the_source_is_dropped(packed):
    """An entry id ≥ N (past capacity) or < 0 is dropped: it never lands in a neighbouring source of the
    stack; a SourceKV is a pytree, so it crosses jit."""
    gkv = _stacked(packed)
    new_kv = _store(np.full((2, 2, 32), 9.0, np.float32), MAIN, packed)
    new_ik = _store(np.full((2, 2, 32), 9.0, np.float32), INDEX, packed)
    entry = jnp.asarray([[4, -1], [5, 4]], jnp.int32)  # N = 4
    valid = jnp.ones((2, 2), bool)
    for slot in range(3):
        out = jax.jit(lambda src: src.write(entry, new_kv, new_ik, valid))(gkv.source(slot)).stack()
        for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(gkv), strict=True):
            np.testing.assert_array_equal(_bits(got), _bits(want))


# --------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("make", [init_state, abstract_state], ids=["init_state", "abstract_state"])
@pytest.mark.parametrize("name,batch,cap,fmt,match", [
    ("tiny", 0, 64, "fp4", "batch=0"),
    ("tiny", -1, 64, "fp4", "batch=-1"),
    ("tiny", 2.0, 64, "fp4", "batch=2.0"),
    ("tiny", 1, 7, "fp4", "capacity=7"),
    ("mini", 1, 9, "float", "capacity=9"),
    ("tiny", 1, 0, "fp4", "capacity=0"),
    ("tiny", 1, 65536 + 2, "fp4", "capacity=65538"),
    ("v41_flash", 1, 2**20 + 2, "fp4", "capacity=1048578"),
    ("tiny", 1, 64, "fp8", "cache_format='fp8'"),
    ("tiny", 1, 64, "FP4", "cache_format='FP4'"),
])
def test_bad_state_arguments(make, name, batch, cap, fmt, match):
    with pytest.raises(ValueError, match=match):
        make(preset(name), batch, cap, fmt)


def test_capacity_above_max_positions_names_the_field(tiny):
    with pytest.raises(ValueError, match="max_position_embeddings=65536"):
        init_state(tiny, 1, 2**17)


def test_capacity_at_max_positions_is_fine(tiny):
    state = abstract_state(tiny, 1, 65536)
    assert state.global_kv[1].kv.payload.shape == (1, 1, 65536, 16)
