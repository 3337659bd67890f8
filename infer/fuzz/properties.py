"""The state properties the fuzz harness draws cases for (DESIGN §8, SPEC §11–§12).

Each property draws one batch from `rng`, a case per row, and returns each row's largest difference from its
reference `[B]` (NaN for a row that is not a case of this batch). A `bitwise` property compares programs of the
same shapes, so its reference must match exactly (difference 0); the others compare different programs (other chunk
shapes, verify against prefill, a mesh) and hold to the bench's tolerance (`bench.FLOAT_TOLERANCE` under the float
numerics).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import numpy as np

from csa2 import mesh as mesh_lib, model
from csa2.presets import PAD_ID
from csa2.replay import EXACT, Extend, ReplayPolicy
from infer import generate as gen, prefix_cache
from infer.fuzz.bench import CONTINUATION, Bench, differences
from infer.speculative import speculative_generate

# (window R, split layer), each compiling its prefill: inside one chunk, across chunks, split 5 cutting before a
# non-compressing layer, and R = the bench's prompt columns (None), which covers every prompt
REPLAY_POLICIES = ((3, None), (11, None), (11, 5), (None, None))
BUDGET = 9  # new tokens per generate call (static: one compiled loop); not a multiple of γ + 1, so a verify block
# can overrun it and must be cut
PROMPT_BUCKET = 16  # the generate prompts' longest length (one bucket, so one compiled loop)


class Property(NamedTuple):
    name: str
    check: Callable[[Bench, np.random.Generator], np.ndarray]
    bitwise: bool


def _lengths(bench: Bench, rng: np.random.Generator, low: int = 1) -> np.ndarray:
    return rng.integers(low, bench.prompt + 1, bench.rows).astype(np.int32)


def chunk_exact(bench: Bench, rng: np.random.Generator) -> np.ndarray:
    """An exact prefill fed in any chunking (per row, rows out of step, empty chunks included) ≡ one call."""
    lengths, prompts, cont = _lengths(bench, rng), bench.tokens(rng, bench.prompt), bench.tokens(rng, CONTINUATION)
    one_logits, one = bench.prefill(bench.empty(), prompts, lengths)
    last, state = bench.chunked(prompts, bench.cuts(rng, lengths))
    return differences([(last, one_logits), *zip(bench.readout(state, cont), bench.readout(one, cont))])


def chunk_replay(bench: Bench, rng: np.random.Generator) -> np.ndarray:
    """Bounded replay (SPEC §11) of a prompt fed in any chunking with its `Extend.cold` ≡ one call of the same
    policy; with R ≥ N, also bit for bit the exact prefill under the same chunking."""
    window, split = REPLAY_POLICIES[rng.integers(len(REPLAY_POLICIES))]
    window = bench.prompt if window is None else window
    replay = ReplayPolicy(window=window, split_layer=split)
    lengths, prompts, cont = _lengths(bench, rng), bench.tokens(rng, bench.prompt), bench.tokens(rng, CONTINUATION)
    cuts = bench.cuts(rng, lengths)
    one_logits, one = bench.prefill(bench.empty(), prompts, lengths, replay)
    last, state = bench.chunked(prompts, cuts, replay, Extend.cold(lengths))
    reads = bench.readout(state, cont)
    errors = differences([(last, one_logits), *zip(reads, bench.readout(one, cont))])
    if window >= bench.prompt:
        exact_last, exact = bench.chunked(prompts, cuts)
        same = differences([(last, exact_last), *zip(reads, bench.readout(exact, cont))])
        errors = np.where(same == 0, errors, np.inf)
    return errors


def commit(bench: Bench, rng: np.random.Generator) -> np.ndarray:
    """commit(verify(state, [R, d1 … dγ]), n + 1) ≡ an exact prefill of R, d1 … dn on the same state, for any
    accept length per row (0 … γ + 1) after any prompt length: the same emitted tokens, length, committed
    entries, drafter context windows (through the drafts) and continuation."""
    width = bench.cfg.max_draft + 1
    lengths, prompts = _lengths(bench, rng), bench.tokens(rng, bench.prompt)
    block, bonus = bench.tokens(rng, width), bench.tokens(rng)
    accept, cont = rng.integers(0, width + 1, bench.rows).astype(np.int32), bench.tokens(rng, CONTINUATION)
    _, state = bench.prefill(bench.empty(), prompts, lengths)
    committed = model.commit(bench.verify(state, block), bench.put(accept), bench.put(bonus))
    _, reference = bench.prefill(state, block, accept)
    want = np.zeros_like(block)  # SPEC §12: accepting R, d1 … dn emits d1 … dn, then the bonus
    for b, n in enumerate(accept):
        want[b, :n] = np.append(block[b, 1:n], bonus[b])[:n]
    emitted = np.where(np.arange(width)[None] < accept[:, None], np.asarray(committed.accept.tokens) - want, 0)
    return differences([(emitted, np.zeros_like(emitted)),
                        *zip(bench.readout(committed, cont), bench.readout(reference, cont))])


def _forked(bench: Bench, rng: np.random.Generator):
    """A prefilled batch, the rows a fork draws (repeats included), which of them diverge, and two continuations:
    `base` for the unforked batch and `tokens` (`base[rows]`, other tokens on the diverging rows)."""
    lengths, prompts = _lengths(bench, rng), bench.tokens(rng, bench.prompt)
    rows = rng.integers(0, bench.rows, bench.rows).astype(np.int32)
    base = bench.tokens(rng, CONTINUATION)
    diverge = rng.random(bench.rows) < 0.3
    tokens = np.where(diverge[:, None], bench.tokens(rng, CONTINUATION), base[rows])
    _, state = bench.prefill(bench.empty(), prompts, lengths)
    return state, rows, diverge, base, tokens


def fork(bench: Bench, rng: np.random.Generator) -> np.ndarray:
    """`fork(state, rows)` is a gather, and a forked row is independent of its siblings: every leaf of row i is
    row `rows[i]` of `state` (NumPy's gather of the same leaves), and each non-diverging row's readout is the same
    when the diverging rows are forked from other source rows and continued with other tokens (one batch position,
    one program: bit for bit)."""
    state, rows, diverge, base, tokens = _forked(bench, rng)
    others = np.where(diverge, rng.integers(0, bench.rows, bench.rows), rows).astype(np.int32)
    forked = model.fork(state, bench.put(rows))
    gathered = differences((np.asarray(a)[rows], b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(forked)))
    siblings = differences(zip(bench.readout(forked, base[rows]),
                               bench.readout(model.fork(state, bench.put(others)), tokens)))
    return np.where(diverge, np.nan, np.maximum(gathered, siblings))


def fork_moved(bench: Bench, rng: np.random.Generator) -> np.ndarray:
    """A forked row continues as its source row does: each non-diverging row's readout equals its source row's in
    the unforked batch continued with the same tokens. The row sits at another batch position there, and XLA:CPU
    may round a row by its position in the batch (on AVX2 the DSpark block's attention does), so to rounding."""
    state, rows, diverge, base, tokens = _forked(bench, rng)
    forked = model.fork(state, bench.put(rows))
    errors = differences([(a[rows], b) for a, b in zip(bench.readout(state, base), bench.readout(forked, tokens))])
    return np.where(diverge, np.nan, errors)


def prefix_hit(bench: Bench, rng: np.random.Generator) -> np.ndarray:
    """A prefix hit under R ≥ N with `short_extend="borrow"` ≡ the cold exact prefill of the whole prompt, with
    and without the prefix's ring snapshot (`infer.prefix_cache`: restore, then the suffix as an extend)."""
    lengths = _lengths(bench, rng, low=2)
    hits = np.array([rng.integers(1, n) for n in lengths], np.int32)
    prompts, cont = bench.tokens(rng, bench.prompt), bench.tokens(rng, CONTINUATION)
    rows = [prompts[b, :n] for b, n in enumerate(lengths)]
    replay = ReplayPolicy(window=bench.capacity, short_extend="borrow")
    snapshots = bench.rows if rng.random() < 0.5 else 0

    def serve(store, batch, policy):
        logits, state, info = prefix_cache.prefill(bench.cfg, bench.params, store, batch, capacity=bench.capacity,
                                                   replay=policy, chunk=bench.chunk, cache_format="float",
                                                   numerics=bench.numerics)
        return np.asarray(logits), state, info

    def store(snapshots):
        return prefix_cache.PrefixCache(bench.cfg, records=2 * bench.rows, snapshots=snapshots, block=bench.capacity)

    warm = store(snapshots)
    serve(warm, [row[:h] for row, h in zip(rows, hits)], replay)
    logits, hit, info = serve(warm, rows, replay)
    cold_logits, cold, _ = serve(store(0), rows, EXACT)
    errors = differences([(logits, cold_logits), *zip(bench.readout(hit, cont), bench.readout(cold, cont))])
    missed = (info["hits"] != hits) | (info["snapshots"] != bool(snapshots))  # each row must really hit
    return np.where(missed, np.inf, errors)


def verify_scratch(bench: Bench, rng: np.random.Generator) -> np.ndarray:
    """What a verify wrote past the accepted rows is never read: two verify blocks that differ only after each
    row's accept length commit to states whose every later read (entries, drafts, continuation) is identical."""
    width = bench.cfg.max_draft + 1
    lengths, prompts = _lengths(bench, rng), bench.tokens(rng, bench.prompt)
    accept, bonus = rng.integers(0, width + 1, bench.rows).astype(np.int32), bench.tokens(rng)
    block = bench.tokens(rng, width)
    other = np.where(np.arange(width)[None] < accept[:, None], block, bench.tokens(rng, width))
    _, state = bench.prefill(bench.empty(), prompts, lengths)
    cont = bench.tokens(rng, CONTINUATION)
    reads = [bench.readout(model.commit(bench.verify(state, b), bench.put(accept), bench.put(bonus)), cont)
             for b in (block, other)]
    return differences(zip(*reads))


def generate_stops(bench: Bench, rng: np.random.Generator) -> np.ndarray:
    """Per-row EOS and budgets in `generate` and `speculative_generate`: each row's output is its output without
    EOS cut after the first EOS (kept) or at the budget, PAD after, its count the kept tokens; greedy or sampled
    (a row's draws never depend on another row's stop). Under the float numerics the greedy speculative output
    is also the plain greedy output."""
    lengths = rng.integers(1, PROMPT_BUCKET + 1, bench.rows)
    lengths[rng.integers(bench.rows)] = PROMPT_BUCKET
    prompts = [p[:n] for p, n in zip(bench.tokens(rng, PROMPT_BUCKET), lengths)]
    budget = BUDGET
    greedy = rng.random() < 0.5
    sampling = gen.Sampling() if greedy else gen.Sampling(temperature=0.8, top_p=0.9)
    seed = int(rng.integers(2**31))
    common = dict(max_new_tokens=budget, sampling=sampling, numerics=bench.numerics, seed=seed)
    errors = np.zeros(bench.rows)
    outputs = {}
    for name, fn in (("plain", gen.generate), ("speculative", speculative_generate)):
        free = fn(bench.cfg, bench.params, prompts, eos_id=None, **common)
        eos = int(rng.choice(free.tokens.reshape(-1)))  # a token some row emits, so some rows stop early
        got = fn(bench.cfg, bench.params, prompts, eos_id=eos, **common)
        first = np.where((free.tokens == eos).any(1), (free.tokens == eos).argmax(1) + 1, budget)
        keep = np.arange(budget)[None] < first[:, None]
        want = np.where(keep, free.tokens, PAD_ID)
        wrong = (got.tokens != want).any(1) | (got.lengths != first) | (free.lengths != budget)
        errors = np.maximum(errors, np.where(wrong, np.inf, 0.0))
        outputs[name] = free.tokens
    if greedy and bench.numerics == "float":
        errors = np.maximum(errors, np.where((outputs["plain"] != outputs["speculative"]).any(1), np.inf, 0.0))
    return errors


@functools.lru_cache(maxsize=2)  # a run's bench and its float reference
def _meshed(bench: Bench) -> Bench:
    """`bench` on a data × tensor × expert mesh of all devices (2 × 2 × 2 on the 8 the command simulates)."""
    n = jax.device_count()
    if n < 8:
        raise ValueError(f"sharded: {n} device(s); run python -m infer.fuzz --property sharded (it simulates 8 CPU "
                         "devices) or give JAX 8 devices")
    mesh = mesh_lib.make_mesh({"data": 2, "tensor": 2, "expert": 2}, devices=jax.devices()[:8])
    return bench.on_mesh(mesh, mesh_lib.rules_for("mini"))


def sharded(bench: Bench, rng: np.random.Generator) -> np.ndarray:
    """A chunked prefill, a verify, a commit and a continuation on a data × tensor × expert mesh (rows over
    `data`, MoE expert-parallel) ≡ the same calls on one device."""
    width = bench.cfg.max_draft + 1
    lengths, prompts = _lengths(bench, rng), bench.tokens(rng, bench.prompt)
    cuts, block = bench.cuts(rng, lengths), bench.tokens(rng, width)
    accept, bonus = rng.integers(0, width + 1, bench.rows).astype(np.int32), bench.tokens(rng)
    cont = bench.tokens(rng, CONTINUATION)
    reads = []
    for b in (bench, _meshed(bench)):
        last, state = b.chunked(prompts, cuts)
        state = model.commit(b.verify(state, block), b.put(accept), b.put(bonus))
        reads.append([last, *b.readout(state, cont)])
    return differences(zip(*reads))


PROPERTIES = {p.name: p for p in (
    Property("chunk_exact", chunk_exact, bitwise=False),
    Property("chunk_replay", chunk_replay, bitwise=False),
    Property("commit", commit, bitwise=False),
    Property("fork", fork, bitwise=True),
    Property("fork_moved", fork_moved, bitwise=False),
    Property("prefix_hit", prefix_hit, bitwise=False),
    Property("verify_scratch", verify_scratch, bitwise=True),
    Property("generate_stops", generate_stops, bitwise=True),
    Property("sharded", sharded, bitwise=False),
)}
