"""Prefill → decode handoff (`infer.handoff`, `infer.wire`, `infer.pd`): a decode (and a speculative step) after
`receive` is bit for bit the one on the prefill's own state, the ready barrier refuses every corrupted part, the
chunked pipeline ships exactly the package, and two OS processes hand a request over a loopback socket.

Shapes stay fixed (B = 2 rows, capacity 64, chunks of S columns), so each property compiles its programs once and
the examples only change values; bit-for-bit claims compare programs of the same shapes (`csa2.state`)."""

import dataclasses
import json
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from csa2 import model
from csa2.presets import preset
from csa2.replay import EXACT, Extend, ReplayPolicy
from csa2.state import init_state
from infer import handoff, pd, wire
from infer.handoff import Package, Part
from tests.csa2.helpers import keep

MINI = preset("mini")  # W = 16; a ratio-2 stack (3 encoder sources) and a ratio-1 stack (the decoder source)
B, CAP, S = 2, 64, 16
WINDOW = ReplayPolicy(window=20)
SETTINGS = settings(max_examples=6, deadline=None, derandomize=True)


def _prompts(seed, n=CAP - 8):
    return np.random.default_rng(seed).integers(0, 256, (B, n)).astype(np.int32)


def _prefill(params, prompts, lengths, fmt, replay, chunk=S, batch=B, capacity=CAP):
    """`prompts [B, ·]` (`lengths` real tokens per row) prefilled as one extend in chunks of `chunk` columns: the
    last logits of each row and the state."""
    lengths = np.asarray(lengths)
    state, last = init_state(MINI, batch, capacity, fmt), None
    extend = Extend.cold(jnp.asarray(lengths, jnp.int32))
    for c in range(-(-int(lengths.max()) // chunk)):
        n_valid = np.clip(lengths - c * chunk, 0, chunk).astype(np.int32)
        cols = np.zeros((batch, chunk), np.int32)
        cols[:, :prompts.shape[1] - c * chunk] = prompts[:, c * chunk:(c + 1) * chunk]
        logits, state, _ = model.prefill(MINI, params, state, jnp.asarray(cols), jnp.asarray(n_valid), replay, extend)
        last = logits if last is None else jnp.where((n_valid > 0)[:, None], logits, last)
    return np.asarray(last), state


def _speculate(params, state, anchor):
    """What a decode worker computes first, on a copy of `state`: a decode step's logits, the DSpark proposal after
    `anchor` and the verify logits of [anchor, drafts] (SPEC §12)."""
    logits, _ = model.decode_step(MINI, params, keep(state), anchor)
    prop = model.draft(MINI, params, state, anchor, jax.random.PRNGKey(0))
    block = jnp.concatenate([anchor[:, None], prop.tokens], axis=1)
    checked, _ = model.verify(MINI, params, keep(state), block)
    return [np.asarray(x) for x in (logits, prop.logits, prop.confidence, checked)]


def _assert_bitwise(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def _hold_prefix(receiver, sender, slots, since):
    """`receiver` whose slots hold the sender rows' Global entries `[0, since // r)` (what a shared prefix leaves)
    and their own older entries beyond."""
    out = []
    for g_r, g_s, r in zip(receiver.global_kv, sender.global_kv, handoff.stack_ratios(MINI)):
        def put(dst, src, r=r):
            dst = np.array(dst)
            for i, slot in enumerate(slots):
                n = since[i] // r
                dst[slot, :, :n] = np.asarray(src)[i, :, :n]
            return jnp.asarray(dst)
        out.append(jax.tree.map(put, g_r, g_s))
    return receiver.replace(global_kv=tuple(out))


def _other_requests(params, fmt, replay):
    """A receiving state whose slots hold two other requests (so every stale slot is in play)."""
    return _prefill(params, _prompts(99), [41, 13], fmt, replay)[1]


# ------------------------------------------------------------------------------------ the bitwise property

@pytest.mark.parametrize("fmt,replay", [("fp4", EXACT), ("float", EXACT), ("fp4", WINDOW), ("float", WINDOW)],
                         ids=["fp4-exact", "float-exact", "fp4-replay", "float-replay"])
@SETTINGS
@given(lengths=st.lists(st.integers(1, CAP - 8), min_size=B, max_size=B),
       since=st.lists(st.floats(0, 1), min_size=B, max_size=B), swap=st.booleans(), seed=st.integers(0, 2**16))
@example(lengths=[37, 21], since=[0.0, 0.0], swap=True, seed=1)  # odd lengths: a ratio-2 pair straddles, in the tail
def test_decode_after_receive_is_bitwise_the_senders(mini_params, fmt, replay, lengths, since, swap, seed):
    """For any prompt lengths, shared prefix `since` and batch slots, a package received into a state that held
    other requests continues (decode step, draft, verify) bit for bit as the prefill's own state, and its Global
    part holds exactly the entries `[since // r, length // r)`."""
    since = [int(f * n) for f, n in zip(since, lengths)]
    slots = [1, 0] if swap else [0, 1]
    last, sender = _prefill(mini_params, _prompts(seed), lengths, fmt, replay)
    first = np.argmax(last, -1)
    receiver = _hold_prefix(_other_requests(mini_params, fmt, replay), sender, slots, since)
    package = handoff.package(MINI, sender, [0, 1], since=since, first=first)
    want = sum(handoff.package_bytes(MINI, n, fmt, s)["global"] for n, s in zip(lengths, since))
    assert package.parts[0].nbytes == want
    assert package.final.nbytes == B * handoff.package_bytes(MINI, 1, fmt)["state"]
    np.testing.assert_array_equal(package.first_tokens, first)
    got = handoff.receive(MINI, package, receiver, slots)
    anchor = jnp.asarray(first, jnp.int32)
    _assert_bitwise(_speculate(mini_params, sender, anchor),
                    [x[np.argsort(slots)] for x in _speculate(mini_params, got, anchor[np.argsort(slots)])])


def test_handoff_between_capacities_and_batch_slots_round_trips_bit_for_bit(mini_params):
    """A package installs into a larger state (capacity 128, three rows, slots 2 and 0); packaged again from there
    and received at the sender's shapes, it continues bit for bit as the sender."""
    last, sender = _prefill(mini_params, _prompts(3), [45, 30], "fp4", WINDOW)
    first = np.argmax(last, -1)
    big = handoff.receive(MINI, handoff.package(MINI, sender, [0, 1], first=first), init_state(MINI, 3, 128), [2, 0])
    np.testing.assert_array_equal(big.length, [30, 0, 45])
    back = handoff.receive(MINI, handoff.package(MINI, big, [2, 0], first=first), init_state(MINI, B, CAP), [0, 1])
    anchor = jnp.asarray(first, jnp.int32)
    _assert_bitwise(_speculate(mini_params, sender, anchor), _speculate(mini_params, back, anchor))


def test_mutant_package_without_the_compressor_tail_is_caught(mini_params):
    """The property can fail: a package whose ratio-2 tails are zeroed (length 37 leaves position 36 alone in its
    group) changes the decode step, because the next group's entry pools the tail."""
    last, sender = _prefill(mini_params, _prompts(5), [37, 21], "fp4", EXACT)
    package = handoff.package(MINI, sender, [0, 1], first=np.argmax(last, -1))
    final = package.final
    arrays = dict(final.arrays, **{k: np.zeros_like(v) for k, v in final.arrays.items() if k.startswith(".tails[0]")})
    mutant = Package((*package.parts[:-1], dataclasses.replace(final, arrays=arrays)))
    got = handoff.receive(MINI, mutant, init_state(MINI, B, CAP), [0, 1])
    anchor = jnp.asarray(package.first_tokens, jnp.int32)
    # the tail is read when the next group completes: position 37 (row 0) and 21 (row 1) finish their pairs
    a, _ = model.decode_step(MINI, mini_params, keep(sender), anchor)
    b, _ = model.decode_step(MINI, mini_params, got, anchor)
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3


# ------------------------------------------------------------------------------------ the pipeline

def test_chunked_pipeline_ships_the_package_block_by_block(mini_params):
    """Chunks of 5 columns (ratio-2 groups straddle every other chunk end): each chunk's completed entries are
    one block read at the chunk's lengths, never an incomplete group; received, the blocks and the final row
    state are the package cut after the last chunk, and continue bit for bit as the prefill's own state."""
    prompts, lengths = _prompts(7), np.array([37, 22])
    shipped = {True: [], False: []}
    for overlap in (True, False):
        info = pd.prefill_and_ship(MINI, mini_params, [p[:n] for p, n in zip(prompts, lengths)], capacity=CAP,
                                   chunk=5, replay=WINDOW, ship=shipped[overlap].append, overlap=overlap)
    streamed, whole = shipped[True], shipped[False]
    assert len(streamed) == 8 + 1 and len(whole) == 2  # 8 chunks of 5, then the row state
    for c, part in enumerate(streamed[:-1]):
        at = np.minimum(lengths, 5 * (c + 1))
        assert part.meta["at"] == at.tolist()
        for k, r in enumerate(handoff.stack_ratios(MINI)):
            assert [hi for _, hi in part.meta["ranges"][k]] == (at // r).tolist()
    last, sender = _prefill(mini_params, prompts, lengths, "fp4", WINDOW, chunk=5)
    np.testing.assert_array_equal(info["first"], np.argmax(last, -1))
    anchor = jnp.asarray(info["first"], jnp.int32)
    states = [handoff.receive(MINI, Package(tuple(p)), init_state(MINI, B, CAP), [0, 1]) for p in (streamed, whole)]
    _assert_bitwise(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]))
    _assert_bitwise(_speculate(mini_params, sender, anchor), _speculate(mini_params, states[0], anchor))


# ------------------------------------------------------------------------------------ the ready barrier

@pytest.fixture(scope="module")
def sent(mini_params):
    """A good package of rows of lengths 37 and 20 (exact, fp4) and a receiving state."""
    last, sender = _prefill(mini_params, _prompts(11), [37, 20], "fp4", EXACT)
    return handoff.package(MINI, sender, [0, 1], first=np.argmax(last, -1)), sender


def _with(part: Part, meta=None, **arrays) -> Part:
    return dataclasses.replace(part, meta=part.meta | (meta or {}), arrays=part.arrays | arrays)


def _set(a, index, value):
    a = a.copy()
    a[index] = value
    return a


def _grow_block(p):
    """Row 0's ratio-1 range extended by one entry past `at` (an entry that was not complete when read)."""
    ranges = [list(map(list, r)) for r in p.parts[0].meta["ranges"]]
    ranges[1][0][1] += 1
    arrays = {k: np.concatenate([v, v[:, :1]], axis=1) if k.startswith("global[1]") else v
              for k, v in p.parts[0].arrays.items()}
    return Package((dataclasses.replace(p.parts[0], meta=p.parts[0].meta | {"ranges": ranges}, arrays=arrays),
                    p.final))


def _overlap(block: Part) -> Part:
    """A second block holding row 0's ratio-2 entry 17 again (zeros), which the first block already holds."""
    ranges = [[[17, 18], [0, 0]], [[0, 0], [0, 0]]]
    arrays = {k: np.zeros_like(v[:, :1 if k.startswith("global[0]") else 0]) for k, v in block.arrays.items()}
    return dataclasses.replace(block, meta=block.meta | {"ranges": ranges}, arrays=arrays)


def _final(p: Package, meta=None, **arrays) -> Package:
    """`p` with its row state's metadata and arrays updated."""
    return Package((*p.parts[:-1], _with(p.final, meta, **arrays)))


def _array(p: Package, name: str, index, value) -> Package:
    """`p` with one element of a row-state array set to `value`."""
    return _final(p, **{name: _set(p.final.arrays[name], index, value)})


CORRUPTIONS = {
    "ring newer than tails": (lambda p: _final(p, {"at": p.final.meta["at"] | {"swa": [38, 20]}}),
                              "swa were taken at lengths"),
    "draft windows older": (lambda p: _final(p, {"at": p.final.meta["at"] | {"draft": [36, 20]}}),
                            "draft were taken at lengths"),
    "entry beyond length // ratio": (_grow_block, "must be complete when shipped"),
    "block read after the boundary": (lambda p: Package((_with(p.parts[0], {"at": [39, 20]}), p.final)),
                                      "after the row state's boundary"),
    "missing block": (lambda p: Package((p.final,)), "needs Global entries"),
    "block twice": (lambda p: Package((p.parts[0], p.parts[0], p.final)), "needs Global entries"),
    "other config": (lambda p: Package((_with(p.parts[0], {"config": "0" * 16}), p.final)), "meta\\['config'\\]"),
    "other version": (lambda p: _final(p, {"version": 2}), "meta\\['version'\\]"),
    "state part first": (lambda p: Package((p.final, p.parts[0])), "part where a 'state' part belongs"),
    "missing array": (lambda p: Package((p.parts[0], dataclasses.replace(p.final, arrays={
        k: v for k, v in p.final.arrays.items() if k != ".tokens"}))), "expected \\["),
    "wrong dtype": (lambda p: _final(p, **{".floor": p.final.arrays[".floor"].astype(np.float32)}),
                    "'.floor' has \\(shape, dtype\\)"),
    "wrong shape": (lambda p: _final(p, **{".swa.scale": p.final.arrays[".swa.scale"][:, :-1]}),
                    "'.swa.scale' has \\(shape, dtype\\)"),
    "length beyond capacity": (lambda p: _array(p, ".length", 0, CAP + 1), "allocate a larger one"),
    "floor above length": (lambda p: _array(p, ".floor", 0, 38), "\\.floor=\\[38, 0\\]"),
    "token outside the vocabulary": (lambda p: _array(p, ".tokens", (0, 0), 5000), "\\.tokens"),
    "between verify and commit": (lambda p: _array(p, ".accept.width", 0, 3), "commit before handing off"),
    "first outside the vocabulary": (lambda p: _final(p, {"first": [5000, 0]}), "meta.first"),
    "NaN scale byte": (lambda p: _array(p, ".swa.scale", (1, 2, 3, 0), 0xFF), "NaN codes of the 'window' scale"),
    "NaN in a tail": (lambda p: _array(p, ".tails[0].gate", (0, 0, 0, 0), np.nan), "non-finite"),
    "since beyond the blocks": (lambda p: _final(p, {"since": [10, 0], "digest": [[1, 2], [0, 0]]}),
                                "needs Global entries"),
    "overlapping block": (lambda p: Package((p.parts[0], _overlap(p.parts[0]), p.final)), "needs Global entries"),
    "length beyond any state": (lambda p: Package((_with(p.parts[0], {"at": [10**20, 20]}), p.final)),
                                "meta\\['at'\\]"),
    "rows as a float": (lambda p: _final(p, {"rows": 2.0}), "meta\\['rows'\\]=2.0"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_ready_barrier_refuses_a_corrupted_part(sent, name):
    """Each corruption is refused with a ValueError naming the part, before the receiving state is touched (it
    takes the good package afterwards)."""
    package, _ = sent
    corrupt, match = CORRUPTIONS[name]
    state = init_state(MINI, B, CAP)
    with pytest.raises(ValueError, match=match):
        handoff.receive(MINI, corrupt(package), state, [0, 1])
    handoff.receive(MINI, package, state, [0, 1])


def test_ready_barrier_refuses_since_when_the_slot_lacks_the_prefix(sent):
    """A package cut against a shared prefix (`since`) is refused by a slot that does not hold those entries
    (the checksum of entries `[0, since // r)` differs), and accepted once the slot holds them."""
    _, sender = sent
    package = handoff.package(MINI, sender, [0, 1], since=[10, 0])
    with pytest.raises(ValueError, match="do not hold the sender's Global entries"):
        handoff.receive(MINI, package, init_state(MINI, B, CAP), [0, 1])
    held = _hold_prefix(init_state(MINI, B, CAP), sender, [0, 1], [10, 0])
    kv = held.global_kv[0].kv
    kv = dataclasses.replace(kv, payload=kv.payload.at[0, 0, 0, 0].set(kv.payload[0, 0, 0, 0] ^ 0x80))
    flipped = held.replace(global_kv=(held.global_kv[0].replace(kv=kv), *held.global_kv[1:]))
    with pytest.raises(ValueError, match="do not hold the sender's Global entries"):  # one bit of the prefix differs
        handoff.receive(MINI, package, flipped, [0, 1])
    handoff.receive(MINI, package, held, [0, 1])


def test_ready_barrier_refuses_another_cache_format_and_too_few_slots(sent):
    package, _ = sent
    with pytest.raises(ValueError, match="cache_format"):
        handoff.receive(MINI, package, init_state(MINI, B, CAP, "float"), [0, 1])
    with pytest.raises(ValueError, match="meta\\['rows'\\]"):
        handoff.receive(MINI, package, init_state(MINI, B, CAP), [0])
    with pytest.raises(ValueError, match="distinct slots"):
        handoff.receive(MINI, package, init_state(MINI, B, CAP), [1, 1])


def test_package_refuses_rows_it_cannot_hand_off(sent, mini_params):
    _, sender = sent
    with pytest.raises(ValueError, match="at least one committed token"):
        handoff.package(MINI, init_state(MINI, B, CAP), [0])
    with pytest.raises(ValueError, match="since="):
        handoff.package(MINI, sender, [0, 1], since=[38, 0])
    with pytest.raises(ValueError, match="first="):
        handoff.package(MINI, sender, [0, 1], first=[MINI.vocab_size, 0])
    _, spec = model.verify(MINI, mini_params, keep(sender), jnp.zeros((B, 2), jnp.int32))
    with pytest.raises(ValueError, match="between verify and commit"):
        handoff.package(MINI, spec, [0, 1])


# ------------------------------------------------------------------------------------ the wire

def test_wire_round_trip_is_exact_and_malformed_messages_are_refused(sent):
    package, _ = sent
    for part in package.parts:
        back = wire.decode_part(wire.encode_part(part))
        assert (back.kind, back.meta) == (part.kind, json.loads(json.dumps(part.meta)))
        _assert_bitwise([part.arrays[k] for k in part.arrays], [back.arrays[k] for k in part.arrays])
    good = wire.encode_part(package.final)
    header_len = int.from_bytes(good[8:16], "little")
    bad = {
        "does not start with": b"NOTAPART" + good[8:],
        "header length": good[:8] + (1 << 40).to_bytes(8, "little") + good[16:],
        "not UTF-8 JSON": good[:16] + b"\xff" * header_len + good[16 + header_len:],
        "needs [0-9]+ bytes": good[:-1],
        "follow the last array": good + b"\0",
        "dtype in": good.replace(b'"dtype":"int32"', b'"dtype":"int64"', 1),
        "RecursionError": wire.MAGIC + (200_000).to_bytes(8, "little") + b"[" * 200_000,
    }
    for match, message in bad.items():
        with pytest.raises(ValueError, match=match):
            wire.decode_part(message)


def test_decode_refuses_more_rows_than_it_takes_before_allocating(sent):
    package, _ = sent
    huge = _final(package, {"rows": 10**9})
    with pytest.raises(ValueError, match="rows=1000000000; this worker takes 1 … max_rows=64"):
        pd.decode(MINI, None, huge, capacity=CAP, cache_format="fp4", new_tokens=2)


def test_collect_refuses_a_package_beyond_its_budget(sent):
    package, _ = sent
    parts = iter(package.parts)
    with pytest.raises(ValueError, match="exceed max_bytes=100"):
        pd.collect(lambda: next(parts), max_bytes=100)
    parts = iter(package.parts[:1])
    with pytest.raises(ValueError, match="stopped after 1 parts, before the row state"):
        pd.collect(lambda: next(parts, None), max_bytes=10**9)


def test_socket_messages_and_the_size_limit():
    a, b = socket.socketpair()
    with a, b:
        wire.send_message(a, b"x" * 1000)
        assert wire.recv_message(b) == b"x" * 1000
        wire.send_message(a, b"y" * 1000)
        with pytest.raises(ValueError, match="exceeds limit=999"):
            wire.recv_message(b, limit=999)
    a, b = socket.socketpair()
    with b:
        a.close()
        assert wire.recv_message(b) is None
    assert wire.listen().getsockname()[0] == "127.0.0.1"


# ------------------------------------------------------------------------------------ two processes

def test_two_process_handoff_continues_as_one_process_generate():
    """`python -m infer.pd`: a prefill process ships its package over a loopback socket in blocks while it
    prefills; the decode process receives it, passes the barrier and decodes; its greedy tokens equal `generate`'s
    in one process. The two prefill in different chunks (a different program), so they agree to float rounding
    (`csa2.state`); with the float cache a greedy token could only flip on a tie to ~1e-6."""
    out = subprocess.run([sys.executable, "-m", "infer.pd", "--prompt-len", "37", "--chunk", "16", "--new-tokens",
                          "6", "--cache-format", "float"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["equal"], report
    assert report["parts"] == 3 + 1
