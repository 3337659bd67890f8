"""One planted bug per property, each a change a real bug could make, that its property must catch
(`python -m infer.fuzz --mutants`). Planting a mutant of traced code drops every traced program before and after,
so the jitted entry points trace the mutant in and out again.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import jax

from csa2 import compressor, dspark, model, moe
from infer import prefix_cache, speculative


def _tail_dropped() -> list[tuple[object, str, Callable]]:
    """The compressor pools group members of earlier chunks as zeros instead of reading its tail ring."""
    pool = compressor._pool

    def mutant(tail, kv, gate, start, n_valid, ratio):
        return pool(tail.replace(kv=tail.kv * 0), kv, gate, start, n_valid, ratio)
    return [(compressor, "_pool", mutant)]


def _commit_one_row_more() -> list[tuple[object, str, Callable]]:
    """commit sets the length one verified row past what it accepts (the emitted tokens right)."""
    commit = model.commit

    def mutant(state, accept_lens, bonus):
        committed = commit(state, accept_lens, bonus)
        return committed.replace(length=committed.length + 1)
    return [(model, "commit", mutant)]


def _fork_keeps_lengths() -> list[tuple[object, str, Callable]]:
    """fork gathers every buffer but leaves the lengths in the source's row order."""
    fork = model.fork
    return [(model, "fork", lambda state, rows: fork(state, rows).replace(length=state.length))]


def _hit_entry_zeroed() -> list[tuple[object, str, Callable]]:
    """A restored prefix hit loses its last Global KV entry of every stack (a record cut one entry short)."""
    restore = prefix_cache.PrefixCache.restore

    def mutant(self, hit, state, row, prompt, replay):
        if hit.record is not None:
            cut = tuple(jax.tree.map(lambda a: a.at[:, -1:].multiply(0), g) if g.kv.payload.shape[1] else g
                        for g in hit.record.global_kv)
            hit = dataclasses.replace(hit, record=dataclasses.replace(hit.record, global_kv=cut))
        return restore(self, hit, state, row, prompt, replay)
    return [(prefix_cache.PrefixCache, "restore", mutant)]


def _draft_reads_scratch() -> list[tuple[object, str, Callable]]:
    """The drafter's context window ends at the committed length instead of one position before it, so it reads
    the first position a verify wrote past the accepted rows."""
    window_rows = dspark.window_rows
    return [(dspark, "window_rows", lambda length, floor, window, slots: window_rows(length + 1, floor, window, slots))]


def _emit_past_stop() -> list[tuple[object, str, Callable]]:
    """The speculative loop writes one emitted token more than it keeps (past an EOS or the budget)."""
    emit = speculative._emit
    return [(speculative, "_emit", lambda out, count, tokens, n_new: emit(out, count, tokens, n_new + 1))]


def _expert_offset_lost() -> list[tuple[object, str, Callable]]:
    """Under expert parallelism every device takes its experts for the first ones (its offset lost)."""
    local = moe._local_experts

    def mutant(cfg, x, weights, experts, w1, w3, w2, first, impl):
        return local(cfg, x, weights, experts, w1, w3, w2, 0, impl)
    return [(moe, "_local_experts", mutant)]


MUTANTS = {
    "chunk_exact": _tail_dropped,
    "chunk_replay": _tail_dropped,
    "commit": _commit_one_row_more,
    "fork": _fork_keeps_lengths,
    "fork_moved": _fork_keeps_lengths,
    "prefix_hit": _hit_entry_zeroed,
    "verify_scratch": _draft_reads_scratch,
    "generate_stops": _emit_past_stop,
    "sharded": _expert_offset_lost,
}
# their property calls the patched function outside any traced program
HOST_SIDE = {"commit", "fork", "fork_moved", "prefix_hit"}


@contextlib.contextmanager
def planted(prop: str) -> Iterator[str]:
    """The mutant of property `prop` in place (yields its description); everything restored afterwards. A mutant
    of traced code drops the traced programs before and after (so they trace it in, then out again)."""
    patches, traced = MUTANTS[prop](), prop not in HOST_SIDE
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    if traced:
        jax.clear_caches()
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield MUTANTS[prop].__doc__
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        if traced:
            jax.clear_caches()
