"""Prefill → decode handoff: a request's state as a package of plain arrays, and the ready barrier that installs it.

A decode worker continues a request from exactly what the prefill left behind, and nothing else (DESIGN §2):
- the **Global KV** of every KV source (Main KV + Indexer K with their scales, SPEC §4, §8): entries
  `[since // r, length // r)` of each ratio-r stack, where `since` is a prefix the receiver already holds. Global
  entries are causal and append-only, so they can be shipped in blocks as they complete (`infer.pd`);
- the **row state** at one boundary: every layer's SWA ring, the compressor tails (the unfinished ratio-r group),
  the Engram token history, the DSpark context windows, the accept buffer, `length` and `floor`, plus the token the
  prefill sampled at `length` if it drew one (`first`, −1 = none).

A `Package` is a tuple of `Part`s, each a kind, plain JSON metadata and named NumPy arrays (never pickle:
`infer.wire` writes them as a header and raw bytes). Every part names the protocol version, the config fingerprint,
the cache format and its row count. A `"global"` part carries, per stack and row, the entry range `[lo, hi)` it
holds and the row length `at` it was read at; the one `"state"` part carries the row state and the length each of
its components was taken at.

`receive` is the ready barrier: before it touches the state it checks every part (kind, version, config, format,
names, shapes, dtypes, value ranges, NaN codes of packed bytes), that the row state is at one boundary (ring,
tails, history and draft windows taken at `length`), that the Global blocks tile `[since // r, length // r)` per row
and stack with no gap and no overlap, that no block holds an entry that was incomplete when it was read (`hi ≤
at // r`), and, when `since > 0`, that the receiving row holds the same prefix (a checksum of its entries
`[0, since // r)`). A malformed or hostile package can only be refused. Then one jitted scatter installs it into
any batch slots of a state of any capacity that holds the rows; the result continues bit for bit as the sender's
state would, at the same shapes (`csa2.state` says what "bit for bit" covers).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from csa2.checks import is_int, tree_bytes
from csa2.config import ModelConfig
from csa2.layout import kv_stacks
from csa2.state import GlobalKV, State, abstract_state, cache_format, capacity, token_granule
from infer.schedule import config_fingerprint
from infer.values import pow2
from pallas_kernels.stored import Stored

Array = jax.Array

VERSION = 1
COMPONENTS = ("swa", "tails", "tokens", "draft")  # the ring-like parts of the row state, each tagged with its boundary
NO_TOKEN = -1  # `first` of a row whose prefill drew no token


@dataclasses.dataclass(frozen=True)
class Part:
    """One unit of a package (and of the wire): `kind` ("global" | "state"), plain metadata, named arrays."""

    kind: str
    meta: dict
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


@dataclasses.dataclass(frozen=True)
class Package:
    """What a decode worker needs to continue some rows: Global blocks, then the row state (last)."""

    parts: tuple[Part, ...]

    @property
    def final(self) -> Part:
        """The `"state"` part."""
        return self.parts[-1]

    @property
    def first_tokens(self) -> np.ndarray:
        """The token each row's prefill sampled at position `length` (`NO_TOKEN` if none) [n]."""
        return np.asarray(self.final.meta["first"], np.int32)


# ---------------------------------------------------------------------------------------------
# The sender

def package(cfg: ModelConfig, state: State, rows: Sequence[int], *, since=None, first=None) -> Package:
    """Rows `rows` of `state` as a package: the Global entries `[since // r, length // r)` of each ratio-r stack and
    the row state. `since` (an int or one per row, default 0) is a prefix length the receiver already holds;
    `first` (one token per row) is what the prefill sampled at `length`, if it drew one."""
    rows = _slots("rows", rows, state.batch)
    length = np.asarray(state.length)[rows]
    if (length < 1).any():
        raise ValueError(f"package: rows {rows.tolist()} have lengths {length.tolist()}; a row needs at least one "
                         "committed token to be handed off (prefill it first)")
    width = np.asarray(state.accept.width)[rows]
    if width.any():
        raise ValueError(f"package: accept.width={width.tolist()}: a row is between verify and commit; commit (or "
                         "keep the state from before the verify) before handing it off")
    since = _per_row("since", since, len(rows), 0)
    if ((since < 0) | (since > length)).any():
        raise ValueError(f"package: since={since.tolist()} must lie in [0, length={length.tolist()}] per row")
    first = _per_row("first", first, len(rows), NO_TOKEN)
    if ((first < NO_TOKEN) | (first >= cfg.vocab_size)).any():
        raise ValueError(f"package: first={first.tolist()}: a token id in [0, {cfg.vocab_size}), or {NO_TOKEN} "
                         "when the prefill drew none")
    ratios = stack_ratios(cfg)
    lo = since[:, None] // ratios[None]
    hi = length[:, None] // ratios[None]
    blocks = global_part(cfg, global_slices(state, rows, lo, hi), lo, hi, at=length)
    return Package((blocks, state_part(cfg, state, rows, since=since, first=first)))


def global_slices(state: State, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """Device slices holding Global entries `[lo, hi)` `[n, stacks]` of `rows` (dispatched, not waited for), to be
    turned into a part by `global_part`: `(starts [n, stacks], per stack a GlobalKV of [n, G, size, ·])`."""
    entries = [g.kv.rows for g in state.global_kv]
    sizes = tuple(min(pow2(max(int((hi[:, k] - lo[:, k]).max()), 1)), n) for k, n in enumerate(entries))
    starts = np.minimum(lo, np.array(entries)[None] - np.array(sizes)[None]).astype(np.int32)  # slices stay in bounds
    return starts, _slice(state.global_kv, jnp.asarray(rows, jnp.int32), jnp.asarray(starts), sizes)


@functools.partial(jax.jit, static_argnames=("sizes",))
def _slice(global_kv, rows, starts, sizes):
    def one(g: GlobalKV, size: int, row, start):
        return jax.tree.map(lambda a: jax.lax.dynamic_slice(a, (row, 0, start, 0), (1, a.shape[1], size,
                                                                                    a.shape[3]))[0], g)
    return tuple(jax.vmap(functools.partial(one, g, size))(rows, starts[:, k])
                 for k, (g, size) in enumerate(zip(global_kv, sizes)))


def global_part(cfg: ModelConfig, slices, lo: np.ndarray, hi: np.ndarray, at: np.ndarray) -> Part:
    """A `"global"` part from `global_slices`'s output: per stack, rows' entries `[lo, hi)` back to back
    `[G, Σ (hi − lo), ·]`, read when the rows had lengths `at`."""
    starts, stacks = slices
    stacks = jax.device_get(stacks)  # one transfer for every stack and leaf
    arrays = {}
    for k, g in enumerate(stacks):
        for path, host in _named(g):  # [n, G, size, ·]
            pieces = [host[i, :, lo[i, k] - starts[i, k]:hi[i, k] - starts[i, k]] for i in range(host.shape[0])]
            arrays[f"global[{k}]{path}"] = np.ascontiguousarray(np.concatenate(pieces, axis=1))
    meta = _identity(cfg, cache_format(stacks[0].kv), len(at)) | {
        "at": [int(x) for x in at],
        "ranges": [[[int(lo[i, k]), int(hi[i, k])] for i in range(len(at))] for k in range(len(stacks))]}
    return Part("global", meta, arrays)


def state_part(cfg: ModelConfig, state: State, rows: np.ndarray, *, since: np.ndarray, first: np.ndarray) -> Part:
    """The `"state"` part: rows `rows` of every per-row leaf but the Global KV, at one boundary (their lengths)."""
    picked = jax.tree.map(lambda a: np.asarray(a[jnp.asarray(rows)]), _row_state(state))
    length = [int(x) for x in picked.length]
    arrays = {path: np.ascontiguousarray(leaf) for path, leaf in _named(picked)}
    meta = _identity(cfg, cache_format(state.swa), len(rows)) | {
        "since": [int(x) for x in since], "first": [int(x) for x in first],
        "at": {c: length for c in COMPONENTS},
        "digest": _digest(state.global_kv, rows, since[:, None] // stack_ratios(cfg)[None]) if since.any() else None}
    return Part("state", meta, arrays)


# ---------------------------------------------------------------------------------------------
# The receiver: the ready barrier, then one install

def receive(cfg: ModelConfig, package: Package, state: State, rows: Sequence[int]) -> State:
    """`state` with the package's rows installed in batch slots `rows` (any capacity that holds them): refuses
    (ValueError) any package that is not complete and at one boundary, or not for this config and cache format,
    before it touches `state`. `state` is donated once the package passes: keep the returned state."""
    rows = _slots("rows", rows, state.batch)
    if not isinstance(package, Package) or not package.parts or any(not isinstance(p, Part) for p in package.parts):
        raise ValueError(f"receive: package={type(package).__name__}: pass an infer.handoff.Package of Parts "
                         "(from package(), or infer.wire.decode_part on each received message)")
    final = _check_state_part(cfg, package.final, state, len(rows))
    length, since = final.arrays[".length"], np.asarray(final.meta["since"], np.int64)
    blocks = [_check_global_part(cfg, p, state, len(rows)) for p in package.parts[:-1]]
    _check_tiling(cfg, blocks, length, since)
    if since.any():
        held = _digest(state.global_kv, rows, since[:, None] // stack_ratios(cfg)[None])
        bad = [int(rows[i]) for i in range(len(rows)) if since[i] and held[i] != final.meta["digest"][i]]
        if bad:
            raise ValueError(f"receive: since={since.tolist()}, but slots {bad} do not hold the sender's Global "
                             "entries of that prefix; install the prefix first (e.g. PrefixCache.restore) or "
                             "package with since=0")
    return _install(state, jnp.asarray(rows, jnp.int32), _global_writes(cfg, blocks, rows, state),
                    _row_values(final, state))


def _check_state_part(cfg: ModelConfig, part: Part, state: State, n: int) -> Part:
    """`part` if it is a well-formed `"state"` part of `n` rows for `state`'s config, format and capacity."""
    _check_identity(cfg, part, "state", cache_format(state.swa), n)
    template = jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype), _row_state(state))
    _check_arrays(part, dict(_named(template)))
    _check_codes(part, _formats(_row_state(state)))
    a, meta = part.arrays, part.meta
    length, floor = a[".length"], a[".floor"]
    cap = capacity(cfg, state)
    _check_range(part, ".length", length, 1, cap, f"the receiving state holds {cap} tokens; allocate a larger one")
    if ((floor < 0) | (floor > length)).any():
        raise ValueError(f"receive: state part .floor={floor.tolist()} must lie in [0, length={length.tolist()}]")
    pad = cfg.engram_pad_id
    tokens = np.where(a[".tokens"] == pad, 0, a[".tokens"])
    _check_range(part, ".tokens", tokens, 0, cfg.vocab_size - 1, f"token ids or the pad id {pad}")
    _check_range(part, ".accept.tokens", a[".accept.tokens"], 0, cfg.vocab_size - 1, "token ids")
    _check_range(part, ".accept.count", a[".accept.count"], 0, cfg.max_draft + 1, "a commit's count")
    _check_range(part, ".accept.width", a[".accept.width"], 0, 0, "commit before handing off")
    for key in ("since", "first"):
        if not _int_list(meta.get(key), n):
            raise ValueError(f"receive: state part meta[{key!r}]={meta.get(key)!r}: expected {n} integers")
    since, first = np.asarray(meta["since"]), np.asarray(meta["first"])
    if ((since < 0) | (since > length)).any():
        raise ValueError(f"receive: state part meta['since']={since.tolist()} must lie in "
                         f"[0, length={length.tolist()}]")
    _check_range(part, "meta.first", first, NO_TOKEN, cfg.vocab_size - 1, f"a token id, or {NO_TOKEN} for none")
    at = meta.get("at")
    if not isinstance(at, dict) or set(at) != set(COMPONENTS) or not all(_int_list(at[c], n) for c in COMPONENTS):
        raise ValueError(f"receive: state part meta['at']={at!r}: expected the boundary of each of {COMPONENTS}")
    for c in COMPONENTS:
        if at[c] != length.tolist():
            raise ValueError(f"receive: the {c} were taken at lengths {at[c]}, the row state is at {length.tolist()}; "
                             "every part of the row state must come from one boundary (snapshot it once, after the "
                             "last chunk)")
    stacks = len(kv_stacks(cfg))
    digest = meta.get("digest")
    if since.any() and not (isinstance(digest, list) and len(digest) == n
                            and all(_int_list(d, stacks) for d in digest)):
        raise ValueError(f"receive: state part meta['digest']={digest!r}: a package with since > 0 carries one "
                         f"checksum per row and stack ({n} × {stacks}) of the prefix the receiver holds")
    return part


def _check_global_part(cfg: ModelConfig, part: Part, state: State, n: int) -> Part:
    """`part` if it is a well-formed `"global"` part of `n` rows for `state`'s config, format and capacity."""
    _check_identity(cfg, part, "global", cache_format(state.swa), n)
    meta, stacks, ratios = part.meta, kv_stacks(cfg), stack_ratios(cfg)
    at, ranges = meta.get("at"), meta.get("ranges")
    cap = capacity(cfg, state)
    if not _int_list(at, n) or not all(0 <= a <= cap for a in at):
        raise ValueError(f"receive: global part meta['at']={at!r}: expected {n} row lengths in [0, {cap}]")
    if not (isinstance(ranges, list) and len(ranges) == len(stacks) and all(
            isinstance(r, list) and len(r) == n and all(_int_list(x, 2) for x in r) for r in ranges)):
        raise ValueError(f"receive: global part meta['ranges']={ranges!r}: expected, per stack ({len(stacks)}) and "
                         f"row ({n}), an entry range [lo, hi)")
    template = {}
    for k, g in enumerate(state.global_kv):
        count = sum(hi - lo for lo, hi in ranges[k])
        for path, leaf in _named(g):
            template[f"global[{k}]{path}"] = jax.ShapeDtypeStruct((leaf.shape[1], max(count, 0), leaf.shape[3]),
                                                                  leaf.dtype)
        for i, (lo, hi) in enumerate(ranges[k]):
            if not 0 <= lo <= hi <= at[i] // int(ratios[k]) or hi > g.kv.rows:
                raise ValueError(f"receive: global part stack {k} row {i} holds entries [{lo}, {hi}) read at length "
                                 f"{at[i]}: an entry must be complete when shipped (hi ≤ {at[i]} // {ratios[k]}) "
                                 f"and fit the receiving state ({g.kv.rows} entries)")
    _check_arrays(part, template)
    _check_codes(part, {f"global[{k}]{p}": f for k, g in enumerate(state.global_kv) for p, f in _formats(g).items()})
    return part


def _check_tiling(cfg: ModelConfig, blocks: list[Part], length: np.ndarray, since: np.ndarray) -> None:
    """The Global blocks cover `[since // r, length // r)` of every row and stack exactly once, and none was read
    past the row state's boundary."""
    for part in blocks:
        if any(a > int(n) for a, n in zip(part.meta["at"], length)):
            raise ValueError(f"receive: a global part was read at lengths {part.meta['at']}, after the row state's "
                             f"boundary {length.tolist()}; ship the row state after the last block")
    for k, r in enumerate(stack_ratios(cfg)):
        for i in range(len(length)):
            want = [int(since[i]) // r, int(length[i]) // r]
            spans = sorted(tuple(p.meta["ranges"][k][i]) for p in blocks if p.meta["ranges"][k][i][0] <
                           p.meta["ranges"][k][i][1])
            edges = [want[0]] + [hi for _, hi in spans]  # each span starts where the previous one ended
            if [lo for lo, _ in spans] != edges[:-1] or edges[-1] != want[1]:
                raise ValueError(f"receive: row {i} stack {k} (ratio {r}) needs Global entries [{want[0]}, {want[1]}) "
                                 f"(since={int(since[i])}, length={int(length[i])}); the blocks hold {spans}. Wait "
                                 "for every block before the row state, and never ship an incomplete group")


def _global_writes(cfg: ModelConfig, blocks: list[Part], rows: np.ndarray, state: State):
    """Per stack: (Stored entries [M, G, ·], slot [M], entry [M]) of every block, padded to a power of two with
    writes that fall out of bounds (dropped)."""
    writes = []
    for k, g in enumerate(state.global_kv):
        spans = [(rows[i], lo, hi) for part in blocks for i, (lo, hi) in enumerate(part.meta["ranges"][k])]
        values = {path: [part.arrays[f"global[{k}]{path}"] for part in blocks] for path, _ in _named(g)}
        m = sum(hi - lo for _, lo, hi in spans)
        pad = pow2(max(m, 1)) - m
        slot = np.concatenate([np.full(hi - lo, row, np.int32) for row, lo, hi in spans] + [np.zeros(pad, np.int32)])
        entry = np.concatenate([np.arange(lo, hi, dtype=np.int32) for _, lo, hi in spans]
                               + [np.full(pad, g.kv.rows, np.int32)])  # out of bounds → dropped
        leaves = []
        for path, leaf in _named(g):
            joined = np.concatenate([np.zeros((leaf.shape[1], 0, leaf.shape[3]), leaf.dtype), *values[path]], axis=1)
            leaves.append(np.pad(joined.transpose(1, 0, 2), ((0, pad), (0, 0), (0, 0))))
        writes.append((jax.tree.unflatten(jax.tree.structure(g), leaves), slot, entry))
    return tuple(writes)


def _row_values(final: Part, state: State) -> State:
    """The state part's arrays as a row state (the receiving state's structure, no Global KV)."""
    template = _row_state(state)
    return jax.tree.unflatten(jax.tree.structure(template), [final.arrays[p] for p, _ in _named(template)])


@functools.partial(jax.jit, donate_argnums=(0,))
def _install(state: State, rows: Array, writes, values: State) -> State:
    global_kv = tuple(jax.tree.map(lambda buf, x: buf.at[slot, :, entry].set(x, mode="drop"), g, entries)
                      for g, (entries, slot, entry) in zip(state.global_kv, writes))
    rest = jax.tree.map(lambda buf, x: buf.at[rows].set(x), _row_state(state), values)
    return rest.replace(global_kv=global_kv)


# ---------------------------------------------------------------------------------------------
# Sizes

def package_bytes(cfg: ModelConfig, length: int, fmt: str = "fp4", since: int = 0) -> dict[str, int]:
    """Array bytes of one row's package at `length` tokens (shipping `[since, length)`), from the state's shapes:
    `{"global": ..., "state": ..., "total": ...}` (the wire adds a small JSON header per part)."""
    state = abstract_state(cfg, 1, token_granule(cfg), fmt)  # per-entry and per-row sizes only
    per_entry = [tree_bytes(g) // g.kv.rows for g in state.global_kv]
    glob = sum(e * (length // r - since // r) for e, r in zip(per_entry, stack_ratios(cfg)))
    rest = tree_bytes(_row_state(state))
    return {"global": int(glob), "state": int(rest), "total": int(glob + rest)}


# ---------------------------------------------------------------------------------------------
# Helpers

def _row_state(state: State) -> State:
    return state.replace(global_kv=())


def _named(tree: Any) -> list[tuple[str, Any]]:
    """Leaves of `tree` with their paths (`.swa.payload`, `.tails[0].kv`, ...): the array names of a part."""
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _formats(tree: Any) -> dict[str, tuple]:
    """`{name: (format, "payload" | "scale")}` of every packed leaf of `tree` (the others are absent)."""
    out = {}
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Stored))[0]:
        if isinstance(node, Stored) and node.packed:
            name = jax.tree_util.keystr(path)
            out[f"{name}.payload"], out[f"{name}.scale"] = (node.fmt, "payload"), (node.fmt, "scale")
    return out


def _nan_codes(fmt, field: str) -> tuple[int, ...]:
    """Byte values that decode to NaN: e4m3 payloads and scales 0x7F / 0xFF, ue8m0 scales 0xFF; e2m1 has none."""
    if field == "payload":
        return (0x7F, 0xFF) if fmt.payload_bits == 8 else ()
    return (0xFF,) if jnp.dtype(fmt.scale_dtype) == jnp.dtype(jnp.float8_e8m0fnu) else (0x7F, 0xFF)


def _check_codes(part: Part, formats: dict) -> None:
    """No packed byte decodes to NaN; float arrays are finite."""
    for name, a in part.arrays.items():
        if name in formats:
            fmt, field = formats[name]
            bad = np.isin(a, _nan_codes(fmt, field))
            if bad.any():
                raise ValueError(f"receive: {part.kind} part array {name!r} holds {int(bad.sum())} NaN codes of the "
                                 f"{fmt.name!r} {field}; the package is corrupt (re-send it)")
        elif a.dtype == np.float32 and not np.isfinite(a).all():
            raise ValueError(f"receive: {part.kind} part array {name!r} holds non-finite values; the package is "
                             "corrupt (re-send it)")


def _identity(cfg: ModelConfig, fmt: str, n: int) -> dict:
    return {"version": VERSION, "config": config_fingerprint(cfg), "cache_format": fmt, "rows": n}


def _check_identity(cfg: ModelConfig, part: Part, kind: str, fmt: str, n: int) -> None:
    if part.kind != kind:
        raise ValueError(f"receive: got a {part.kind!r} part where a {kind!r} part belongs; a package is its global "
                         "parts, then one state part")
    if not isinstance(part.meta, dict):
        raise ValueError(f"receive: {kind} part meta is a {type(part.meta).__name__}; expected a dict")
    want = _identity(cfg, fmt, n)
    for key, value in want.items():
        got = part.meta.get(key)
        if type(got) is not type(value) or got != value:
            raise ValueError(f"receive: {kind} part meta[{key!r}]={got!r}, this receiver expects "
                             f"{value!r}; hand off between workers of one model (config), cache format and protocol "
                             "version, and receive as many slots as the package has rows")


def _check_arrays(part: Part, template: dict) -> None:
    """Exactly the template's names, each with its shape and dtype."""
    if not isinstance(part.arrays, dict) or set(part.arrays) != set(template):
        got = sorted(map(str, part.arrays)) if isinstance(part.arrays, dict) else type(part.arrays).__name__
        raise ValueError(f"receive: {part.kind} part arrays {got}; expected {sorted(template)}")
    for name, want in template.items():
        a = part.arrays[name]
        if not isinstance(a, np.ndarray) or a.shape != tuple(want.shape) or a.dtype != np.dtype(want.dtype):
            got = (getattr(a, "shape", None), getattr(a, "dtype", type(a).__name__))
            raise ValueError(f"receive: {part.kind} part array {name!r} has (shape, dtype) {got}; expected "
                             f"{(tuple(want.shape), np.dtype(want.dtype))}")


def _check_range(part: Part, name: str, values: np.ndarray, low: int, high: int, fix: str) -> None:
    if values.size and (values.min() < low or values.max() > high):
        raise ValueError(f"receive: {part.kind} part {name} = {np.asarray(values).tolist()} is outside its range "
                         f"({fix})")


def _int_list(x, n: int) -> bool:
    return isinstance(x, list) and len(x) == n and all(is_int(v) for v in x)


def _slots(name: str, rows, batch: int) -> np.ndarray:
    arr = np.asarray(rows)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name}={rows!r}: give a non-empty list of batch slots")
    if (arr < 0).any() or (arr >= batch).any() or len(set(arr.tolist())) != arr.size:
        raise ValueError(f"{name}={arr.tolist()}: distinct slots in [0, {batch}) of the state")
    return arr.astype(np.int32)


def _per_row(name: str, value, n: int, default: int) -> np.ndarray:
    if value is None:
        return np.full(n, default, np.int64)
    arr = np.broadcast_to(np.asarray(value), (n,)) if np.ndim(value) == 0 else np.asarray(value)
    if arr.shape != (n,) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"package: {name}={value!r}: an integer, or one per row ({n})")
    return arr.astype(np.int64)


def stack_ratios(cfg: ModelConfig) -> np.ndarray:
    """The compress ratio of each stack of `layout.kv_stacks(cfg)`."""
    return np.array([cfg.compress_ratios[s[0]] for s in kv_stacks(cfg)], np.int64)


def _digest(global_kv, rows: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    """A checksum per row and stack of the entries `[0, counts[i, k])` of slot `rows[i]`: what a receiver compares
    to be sure it holds the prefix a package was cut against (independent of the state's capacity)."""
    lanes = np.asarray(_checksum(global_kv, jnp.asarray(rows, jnp.int32), jnp.asarray(counts, jnp.int32)))
    return ((lanes[..., 0].astype(np.uint64) << np.uint64(32)) | lanes[..., 1].astype(np.uint64)).tolist()


@jax.jit
def _checksum(global_kv, rows, counts):
    """Two 32-bit lanes per row and stack: each element's bits, multiplied by an odd weight of its place (a
    bijection, so no bit is lost) and mixed (xor-shift, multiply), summed modulo 2³²."""
    out = []
    for k, g in enumerate(global_kv):
        lanes = []
        for constant, mix in ((0x9E3779B1, 0x85EBCA6B), (0xC2B2AE35, 0x27D4EB2F)):
            total = jnp.zeros(rows.shape, jnp.uint32)
            for salt, leaf in enumerate(jax.tree.leaves(g), start=1):
                a = leaf[rows]  # [n, G, N, w]
                bits = jax.lax.bitcast_convert_type(a, jnp.uint32) if a.dtype == jnp.float32 else a.astype(jnp.uint32)
                _, groups, _, w = a.shape
                e = jnp.arange(a.shape[2], dtype=jnp.uint32)[None, None, :, None]
                idx = (e * groups + jnp.arange(groups, dtype=jnp.uint32)[None, :, None, None]) * w + jnp.arange(
                    w, dtype=jnp.uint32)
                h = (bits + jnp.uint32(salt)) * ((idx * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(constant))
                h = (h ^ (h >> 15)) * jnp.uint32(mix)
                h = h ^ (h >> 13)
                keep = e < counts[:, k].astype(jnp.uint32)[:, None, None, None]
                total = total * jnp.uint32(31) + jnp.sum(jnp.where(keep, h, 0), axis=(1, 2, 3), dtype=jnp.uint32)
            lanes.append(total)
        out.append(jnp.stack(lanes, -1))
    return jnp.stack(out, axis=1)  # [n, stacks, 2]
