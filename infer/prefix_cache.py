"""A prefix store for prefix hits (SPEC §11): Global KV kept long, ring snapshots kept short.

What a prompt leaves in a row of the state splits in two (DESIGN §2):
- its **Global KV** (every KV source's compressed entries): 890 B per token at the release's
  numbers, causal (the entries of a prompt's first P tokens do not depend on what follows), so one
  record serves every prefix of the prompt. `insert` keys it by the hash of the prompt's first P
  tokens for every multiple P of `block` and for the prompt itself.
- its **snapshot**: the SWA rings of every layer, the compressor tails, the Engram token history,
  the DSpark context windows and the decoder floor, a fixed 2.6 MB per sequence at the release's
  numbers and valid only at the prompt's exact length. Snapshots have their own, smaller capacity.

Both are evicted least recently used first. `lookup` finds the longest stored prefix of a prompt
(at most its length − 1: the prefill needs one new token for the logits). `restore` writes a hit
into a row of a state: with a snapshot, the row is the prompt's state at P (the suffix `[P, N)` is
the extend, `short_extend` decides its decoder window); without one, the row holds the Global KV
only and the extend starts before the hit (`Extend.replaying`): the encoder replays the prefix's
last W tokens to rebuild the rings, the Global KV is read and never rewritten. `prefill` runs a
batch of prompts through lookup, restore, prefill and insert.

Counters (`stats`): lookups, hits, snapshot hits, misses, hit tokens, inserts and the evictions of
each kind; `nbytes` the stored bytes. The store is host-side bookkeeping around device arrays; the
model's entry points stay pure.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import model
from csa2.boundary import resolve_cache_format
from csa2.checks import is_int, tree_bytes
from csa2.config import ModelConfig
from csa2.layout import kv_stacks
from csa2.replay import Extend, ReplayPolicy
from csa2.state import State, cache_format, capacity, init_state
from infer.schedule import config_fingerprint

Array = jax.Array


def _key(tokens: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest()


def _row(tree: Any, b: int) -> Any:
    return jax.tree.map(lambda a: a[b], tree)


def _put_row(tree: Any, b: int, row: Any) -> Any:
    return jax.tree.map(lambda a, r: a.at[b].set(r), tree, row)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A row's rings at the prompt's exact length: SWA of every layer, compressor tails, Engram token history,
    DSpark context windows and the decoder floor."""

    swa: Any
    tails: Any
    tokens: Array
    draft: Any
    floor: Array


@dataclasses.dataclass(frozen=True)
class Record:
    """What `insert` kept of one prompt: its tokens, the complete Global KV entries of each stack (`[G, n, ·]`,
    n = length // ratio), the config and cache format they belong to."""

    tokens: np.ndarray
    global_kv: tuple
    config: str
    cache_format: str

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class Hit:
    """A lookup's answer: the `length` of the longest stored prefix (0 = miss), the record holding it and
    whether the snapshot at exactly that length is there."""

    length: int
    record: Record | None = None
    snapshot: Snapshot | None = None


class PrefixCache:
    """Prefixes of `cfg`'s prompts: at most `records` Global KV records and `snapshots` ring snapshots, each
    evicted least recently used first; Global KV is found at every multiple of `block` tokens."""

    def __init__(self, cfg: ModelConfig, *, records: int = 16, snapshots: int = 4, block: int = 64):
        for name, value, low in (("records", records, 1), ("snapshots", snapshots, 0), ("block", block, 1)):
            if not is_int(value) or value < low:
                raise ValueError(f"PrefixCache.{name}={value!r}: use an integer ≥ {low}")
        self.cfg, self.block = cfg, block
        self.config = config_fingerprint(cfg)
        self._capacity = {"records": records, "snapshots": snapshots}
        self._records: collections.OrderedDict[str, Record] = collections.OrderedDict()  # by the prompt's key
        self._snapshots: collections.OrderedDict[str, Snapshot] = collections.OrderedDict()
        self._prefixes: dict[tuple[int, str], str] = {}  # (P, key of the first P tokens) → record key
        self.stats = collections.Counter()

    # ----------------------------------------------------------------------------------- lookup
    def lookup(self, prompt) -> Hit:
        """The longest stored prefix of `prompt` (1-D token ids) shorter than it; counts the lookup."""
        prompt = _tokens("prompt", prompt)
        self.stats["lookups"] += 1
        for length in sorted({p for p, _ in self._prefixes if p < len(prompt)}, reverse=True):
            owner = self._prefixes.get((length, _key(prompt[:length])))
            if owner is None:
                continue
            record = self._records[owner]
            self._records.move_to_end(owner)
            snapshot = self._snapshots.get(owner) if record.length == length else None
            if snapshot is not None:
                self._snapshots.move_to_end(owner)
            self.stats["hits"] += 1
            self.stats["snapshot_hits"] += snapshot is not None
            self.stats["hit_tokens"] += length
            return Hit(length=length, record=record, snapshot=snapshot)
        self.stats["misses"] += 1
        return Hit(length=0)

    # ----------------------------------------------------------------------------------- insert
    def insert(self, prompt, state: State, row: int = 0) -> None:
        """Keep row `row` of `state`, which holds exactly `prompt` (its length is `len(prompt)`): its Global KV
        under every block prefix and the prompt, and its snapshot."""
        prompt = _tokens("prompt", prompt)
        self._check_state(state, "insert")
        length = int(np.asarray(state.length)[row])
        if length != len(prompt) or length == 0:
            raise ValueError(f"insert: state.length[{row}]={length} but the prompt has {len(prompt)} tokens; insert "
                             "the row right after its prefill, with the tokens it holds")
        ratios = [self.cfg.compress_ratios[s[0]] for s in kv_stacks(self.cfg)]
        entries = tuple(jax.tree.map(lambda a, n=length // r: a[row, :, :n], g)
                        for g, r in zip(state.global_kv, ratios))
        owner = _key(prompt)
        self._records[owner] = Record(tokens=prompt, global_kv=entries, config=self.config,
                                      cache_format=cache_format(state.swa))
        self._records.move_to_end(owner)
        for p in [*range(self.block, length, self.block), length]:
            self._prefixes.setdefault((p, _key(prompt[:p])), owner)
        if self._capacity["snapshots"]:
            self._snapshots[owner] = Snapshot(swa=_row(state.swa, row), tails=_row(state.tails, row),
                                              tokens=state.tokens[row], draft=_row(state.draft, row),
                                              floor=state.floor[row])
            self._snapshots.move_to_end(owner)
        self.stats["inserts"] += 1
        self._evict()

    def _evict(self) -> None:
        while len(self._snapshots) > self._capacity["snapshots"]:
            self._snapshots.popitem(last=False)
            self.stats["snapshot_evictions"] += 1
        while len(self._records) > self._capacity["records"]:
            owner, _ = self._records.popitem(last=False)
            self._snapshots.pop(owner, None)
            for (p, key), held in list(self._prefixes.items()):
                if held == owner:  # another record holding the same prefix takes it over, else it is gone
                    heir = next((k for k, r in self._records.items() if r.length >= p and _key(r.tokens[:p]) == key),
                                None)
                    if heir is None:
                        del self._prefixes[(p, key)]
                    else:
                        self._prefixes[(p, key)] = heir
            self.stats["evictions"] += 1

    @property
    def nbytes(self) -> dict[str, int]:
        """Bytes held: Global KV records and snapshots."""
        return {"global_kv": sum(tree_bytes(r.global_kv) for r in self._records.values()),
                "snapshots": sum(tree_bytes((s.swa, s.tails, s.tokens, s.draft, s.floor))
                                 for s in self._snapshots.values())}

    # ----------------------------------------------------------------------------------- restore
    def restore(self, hit: Hit, state: State, row: int, prompt, replay: ReplayPolicy) -> tuple[State, int]:
        """Row `row` of `state` made ready for `prompt` after `hit`; returns the state and the position the
        row's extend starts at (feed `prompt[start:]` with `Extend(start, len(prompt), hit.length)`).

        A miss empties the row (start 0). A hit with its snapshot is the prompt's state at P (start P).
        Without the snapshot the row gets the hit's Global KV, empty rings and the token history before
        the replay start `Extend.replaying(...)` (start < P, SPEC §11)."""
        prompt = _tokens("prompt", prompt)
        self._check_state(state, "restore")
        if hit.length >= len(prompt):
            raise ValueError(f"restore: hit.length={hit.length} but the prompt has {len(prompt)} tokens; a prefix "
                             "must be shorter than the prompt (look it up with lookup(prompt))")
        fmt = cache_format(state.swa)
        if hit.record is not None and (hit.record.config != self.config or hit.record.cache_format != fmt):
            raise ValueError(f"restore: the hit was stored for config {hit.record.config} "
                             f"({hit.record.cache_format} cache), this store and state are for config {self.config} "
                             f"({fmt} cache); look prefixes up in the store of the model that made them")
        if len(prompt) > capacity(self.cfg, state):
            raise ValueError(f"restore: the prompt has {len(prompt)} tokens, the state holds "
                             f"{capacity(self.cfg, state)}; allocate a larger state")
        empty = _row(init_state(self.cfg, 1, capacity(self.cfg, state), fmt), 0)
        if hit.length == 0:
            return _put_row(state, row, empty), 0
        fresh = jax.tree.map(lambda g, e: e.at[:, :g.shape[1]].set(g), hit.record.global_kv, empty.global_kv)
        if hit.snapshot is not None:
            s = hit.snapshot
            new = empty.replace(length=jnp.int32(hit.length), floor=s.floor, global_kv=fresh, swa=s.swa,
                                tails=s.tails, tokens=s.tokens, draft=s.draft)
            return _put_row(state, row, new), hit.length
        start = int(Extend.replaying(self.cfg, replay, hit.length, len(prompt)).start)
        history = empty.tokens
        for p in range(max(start - history.shape[0], 0), start):
            history = history.at[p % history.shape[0]].set(int(prompt[p]))
        new = empty.replace(length=jnp.int32(start), floor=jnp.int32(start), global_kv=fresh, tokens=history)
        return _put_row(state, row, new), start

    def _check_state(self, state: State, where: str) -> None:
        fmt = cache_format(state.swa)
        want = jax.eval_shape(lambda: init_state(self.cfg, state.batch, capacity(self.cfg, state), fmt))
        got = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
        if jax.tree.structure(want) != jax.tree.structure(got) or jax.tree.leaves(want) != jax.tree.leaves(got):
            raise ValueError(f"{where}: the state does not have the shapes of this store's config {self.config}; "
                             "use the store of the model that made the state")


def _tokens(name: str, tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or len(tokens) == 0:
        raise ValueError(f"{name}: expected a non-empty 1-D array of token ids, got shape {tokens.shape} "
                         f"dtype {tokens.dtype}")
    return tokens.astype(np.int32)


# --------------------------------------------------------------------------------------------- a batch

def prefill(cfg: ModelConfig, params, store: PrefixCache, prompts: Sequence, *, capacity: int,
            replay: ReplayPolicy = ReplayPolicy(), chunk: int = 256,
            cache_format: str | None = None, numerics: str = "spec") -> tuple[Array, State, dict]:
    """Prefill `prompts` (a list of 1-D token arrays, one row each) through the store: look each up, restore
    its hit, feed the rest in chunks of `chunk` columns as one extend per row, insert every prompt (`numerics`:
    `model.prefill`'s; `cache_format` None: `csa2.state.default_cache_format(numerics)`).

    Returns each row's last logits [B, V], the state (row b at `len(prompts[b])`) and
    `{"hits": [B] hit lengths, "snapshots": [B] bool, "starts": [B] extend starts, "work": token×layer count}`.
    """
    if not is_int(chunk) or chunk < 1:
        raise ValueError(f"prefill: chunk={chunk!r}: use a positive number of columns")
    prompts = [_tokens(f"prompts[{b}]", p) for b, p in enumerate(prompts)]
    cache_format = resolve_cache_format(numerics, cache_format)
    state = init_state(cfg, len(prompts), capacity, cache_format)
    hits, starts = [], []
    for b, prompt in enumerate(prompts):
        hit = store.lookup(prompt)
        state, start = store.restore(hit, state, b, prompt, replay)
        hits.append(hit)
        starts.append(start)
    start = np.asarray(starts, np.int32)
    end = np.asarray([len(p) for p in prompts], np.int32)
    extend = Extend(start=jnp.asarray(start), end=jnp.asarray(end),
                    hit=jnp.asarray([h.length for h in hits], jnp.int32))
    logits, work, done = None, 0, start.copy()
    while (done < end).any():
        n_valid = np.minimum(end - done, chunk)
        cols = np.zeros((len(prompts), chunk), np.int32)
        for b, prompt in enumerate(prompts):
            cols[b, :n_valid[b]] = prompt[done[b]:done[b] + n_valid[b]]
        out, state, aux = model.prefill(cfg, params, state, jnp.asarray(cols), jnp.asarray(n_valid), replay=replay,
                                        extend=extend, numerics=numerics)
        logits = out if logits is None else jnp.where(jnp.asarray(n_valid > 0)[:, None], out, logits)
        work += int(aux["work"])
        done += n_valid
    for b, prompt in enumerate(prompts):
        store.insert(prompt, state, b)
    return logits, state, {"hits": np.asarray([h.length for h in hits]),
                           "snapshots": np.asarray([h.snapshot is not None for h in hits]),
                           "starts": start, "work": work}
