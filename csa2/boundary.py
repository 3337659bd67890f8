"""The host-side layer in front of the jitted entry points (DESIGN §7).

An `EntryPoint` is a jitted function (static config and policies, donated state) behind one
check of its arguments: shapes and types always, values where they are concrete (on the host).
Called from inside another trace (a generate loop), the arguments are tracers and only their
shapes are checked; the model code itself never asks whether a value is traced. Reading a device
value waits for the computation that makes it, so a host loop that wants its steps to overlap calls
`.trusted(...)`, which checks shapes only. Bad input raises `ValueError` naming the field, the value
and the fix.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from csa2.config import ModelConfig
from csa2.mesh import REPLICATED, ROWS, Placement, Rules, check_rules, replicated, rows, use_rules
from csa2.quant import NUMERICS
from csa2.replay import Extend, ReplayPolicy
from csa2.state import State, capacity, default_cache_format

Array = jax.Array


def concrete(x) -> np.ndarray | None:
    """`x` as a host array, or None while it is being traced, only described by its shape and dtype
    (`jax.ShapeDtypeStruct`, for ahead-of-time lowering) or partly held by other processes (a multi-process
    mesh): then only its shape can be checked."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return None
    try:
        return None if isinstance(x, jax.Array) and not x.is_fully_addressable else np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _described(arg):
    """An argument as `trusted` checks it: every device array as its shape and dtype. Parameters pass as
    they are (no check reads them, and rebuilding an `nnx.State` costs milliseconds)."""
    if isinstance(arg, nnx.State):
        return arg
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, arg)


class EntryPoint:
    """`jax.jit(fn, ...)` with `check(*args, **kwargs)` run before every call, trace or lowering.

    `place` names, per argument, how it lies on a device mesh (a `csa2.mesh` placement: `ROWS`, `REPLICATED`,
    `PARAMS` or a function of the same form; an argument not named is replicated), and `out` how the outputs do
    (a prefix of the output pytree whose leaves are `ROWS`, `REPLICATED` or the name of an argument whose
    shardings an output keeps, e.g. the state a step returns; a dict names the keys an output dict may have).
    With them, `.on(mesh, rules)` is the same entry point compiled for a mesh.
    """

    def __init__(self, fn: Callable, check: Callable, *, place: Mapping[str, Placement] | None = None,
                 out: Any = None, **jit_kwargs):
        functools.update_wrapper(self, fn)
        self._fn, self._check, self._jit_kwargs = fn, check, jit_kwargs
        self._place, self._out = dict(place or {}), out
        self._signature = inspect.signature(fn)
        self._jitted = jax.jit(fn, **jit_kwargs)
        self._meshes: dict[tuple, OnMesh] = {}

    def on(self, mesh: Mesh, rules: Rules) -> "OnMesh":
        """This entry point compiled for `mesh` with `rules` (`OnMesh`; one per mesh and rules, so its compiled
        programs are reused however often it is asked for)."""
        if self._out is None:
            raise ValueError(f"{self.__name__}: declares no placements (place=, out=), so it runs on one device only")
        key = (mesh, tuple(sorted(rules.items())))
        if key not in self._meshes:
            check_rules(rules)
            self._meshes[key] = OnMesh(self, mesh, rules)
        return self._meshes[key]

    def check(self, *args, **kwargs) -> None:
        """The host check alone (for a caller that jits `__wrapped__` itself, e.g. with explicit shardings)."""
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        self._check(**bound.arguments)

    def __call__(self, *args, **kwargs):
        self.check(*args, **kwargs)
        return self._jitted(*args, **kwargs)

    def trusted(self, *args, **kwargs):
        """The call with the checks that read device values skipped: shapes, types and host (numpy)
        values are still checked, but no `jax.Array` argument is copied back to the host, so a host
        loop feeding the model its own outputs (argmax tokens, the state it advanced) dispatches the next
        step while this one runs. Token ids in the vocabulary and positions within capacity are then the
        caller's to guarantee (check the first call, size the state for the whole loop)."""
        self.check(*map(_described, args), **{k: _described(v) for k, v in kwargs.items()})
        return self._jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """`jax.jit(...).lower`: `.compile()` it for ahead-of-time use; the result takes the traced arguments."""
        self.check(*args, **kwargs)
        return self._jitted.lower(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        self.check(*args, **kwargs)
        return self._jitted.eval_shape(*args, **kwargs)

    def cache_size(self) -> int:
        """How many programs this entry point has compiled (a decode loop must not add any per step)."""
        return self._jitted._cache_size()

    def without_donation(self) -> Callable:
        """The same jitted function with no donated argument (for measuring what donation saves)."""
        kwargs = {k: v for k, v in self._jit_kwargs.items() if k != "donate_argnames"}
        return jax.jit(self._fn, **kwargs)


def entry_point(check: Callable, **kwargs) -> Callable[[Callable], EntryPoint]:
    """Decorator form of `EntryPoint`."""
    return lambda fn: EntryPoint(fn, check, **kwargs)


class OnMesh:
    """An `EntryPoint` compiled for a device mesh: explicit in and out shardings from its placements (by
    argument name, through the rules' logical axes), its donated arguments donated, its host check run first,
    traced under `jax.set_mesh(mesh)` (so the MoE runs expert-parallel, `csa2.moe`). One program per static
    arguments and argument shapes. The rules are in use while it traces (`csa2.mesh.rules_in_use`: the MoE reads
    its mesh axes from them). Arguments must already be placed (`csa2.sharding.shard_params`,
    `csa2.sharding.init_state`, `jax.device_put(x, self.shardings(name, x))`); an argument in another sharding is
    an error of `jax.jit`, never a silent copy to one device."""

    def __init__(self, entry: EntryPoint, mesh: Mesh, rules: Rules):
        self.entry, self.mesh, self.rules = entry, mesh, rules
        self._programs: dict[tuple, Callable] = {}

    def shardings(self, name: str, value) -> Any:
        """The shardings of argument `name` holding `value` (checked against the mesh)."""
        return self.entry._place.get(name, REPLICATED)(value, self.mesh, self.rules, name)

    def __call__(self, *args, **kwargs):
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            program, values = self._program(args, kwargs)
            return program(*values)

    def lower(self, *args, **kwargs):
        """`jax.jit(...).lower` for placed arrays or `jax.ShapeDtypeStruct`s with shardings: `.compile()` it for
        ahead-of-time use and memory plans."""
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            program, values = self._program(args, kwargs)
            return program.lower(*values)

    def _program(self, args, kwargs) -> tuple[Callable, list]:
        entry = self.entry
        bound = entry._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        entry._check(**bound.arguments)
        # Static: the entry point's static arguments, and any other argument left None (an empty pytree), so a
        # lowered program takes exactly the arrays given, in signature order.
        static_names = set(entry._jit_kwargs.get("static_argnames", ()))
        static = tuple((n, v) for n, v in bound.arguments.items() if n in static_names or v is None)
        names = [n for n, v in bound.arguments.items() if n not in static_names and v is not None]
        values = [bound.arguments[n] for n in names]
        # A program per static values and argument shapes: its placements (and their checks, e.g. a batch that
        # splits over `data`) depend on nothing else, so a cached program needs no per-call host work.
        key = static + tuple((jax.tree.structure(v), tuple(jnp.shape(x) for x in jax.tree.leaves(v))) for v in values)
        if key not in self._programs:
            placed = {n: self.shardings(n, v) for n, v in zip(names, values)}
            fn = _by_name(entry._fn, dict(static), names)
            shapes = jax.eval_shape(fn, *values)
            donate = set(entry._jit_kwargs.get("donate_argnames", ()))
            self._programs[key] = jax.jit(fn, in_shardings=tuple(placed[n] for n in names),
                                          out_shardings=self._out(entry._out, shapes, placed),
                                          donate_argnums=tuple(i for i, n in enumerate(names) if n in donate))
        return self._programs[key], values

    def _out(self, spec, shapes, placed: dict):
        """The out shardings: `spec` (the entry point's `out`) matched against the output structure `shapes`."""
        if isinstance(spec, str):
            return placed[spec]
        if spec is ROWS:
            return rows(self.mesh, self.rules)
        if spec is REPLICATED:
            return replicated(self.mesh)
        if isinstance(spec, dict):
            missing = sorted(set(shapes) - set(spec))
            if missing:
                raise ValueError(f"{self.entry.__name__}: output keys {missing} have no placement in its out=")
            return {k: self._out(spec[k], v, placed) for k, v in shapes.items()}
        if len(spec) != len(shapes):
            raise ValueError(f"{self.entry.__name__}: out= places {len(spec)} outputs, the function returns "
                             f"{len(shapes)}")
        return type(spec)(self._out(s, v, placed) for s, v in zip(spec, shapes))


def _by_name(fn: Callable, static: dict, names: list[str]) -> Callable:
    """`fn` with its static arguments bound, taking the others positionally in `names` order (what
    `jax.jit(..., in_shardings=)` needs), under `fn`'s name (the compiled program's name in profiles)."""
    def bound(*values):
        return fn(**static, **dict(zip(names, values)))
    bound.__name__ = bound.__qualname__ = fn.__name__
    return bound


# ---------------------------------------------------------------------------------------------
# Checks shared by the entry points

def check_config(cfg) -> None:
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg: expected a csa2.config.ModelConfig, got {type(cfg).__name__}")


def check_replay(cfg: ModelConfig, replay) -> None:
    if not isinstance(replay, ReplayPolicy):
        raise ValueError(f"replay={replay!r}: pass a csa2.replay.ReplayPolicy (EXACT for the reference mode)")
    replay.check(cfg)


def check_numerics(numerics, cache_format: str) -> None:
    """`numerics` is one of `quant.NUMERICS`; the float model runs on a float cache (a packed cache rounds every
    entry it stores to SPEC §8, which is not the float model)."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics={numerics!r}: use one of {NUMERICS} (\"spec\": the SPEC §8 FP4/FP8 numerics, "
                         "\"float\": the float model)")
    if numerics == "float" and cache_format != "float":
        raise ValueError(f"numerics='float' with cache_format={cache_format!r}: the float model stores float "
                         "values; use cache_format='float' (init_state(..., cache_format='float'))")


def resolve_cache_format(numerics, cache_format: str | None) -> str:
    """The cache a call that builds its own state runs on: `cache_format`, or `numerics`' default
    (`csa2.state.default_cache_format`) when None; checked against `numerics`."""
    cache_format = default_cache_format(numerics) if cache_format is None else cache_format
    check_numerics(numerics, cache_format)
    return cache_format


def check_token_ids(cfg: ModelConfig, tokens, n_valid=None) -> None:
    """Token ids `[B, S]` are integers in the vocabulary (the first `n_valid` of each row, when concrete)."""
    if jnp.ndim(tokens) != 2:
        raise ValueError(f"tokens.shape={jnp.shape(tokens)}: expected [B, S]")
    if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
        raise ValueError(f"tokens.dtype={jnp.result_type(tokens)}: token ids must be integers")
    ids = concrete(tokens)
    if ids is None:
        return
    counts = np.full(ids.shape[0], ids.shape[1]) if n_valid is None else concrete(n_valid)
    if counts is None:
        return
    valid = np.arange(ids.shape[1])[None] < counts[:, None]
    bad = ids[valid & ((ids < 0) | (ids >= cfg.vocab_size))]
    if bad.size:
        raise ValueError(f"tokens: ids {sorted(set(bad.tolist()))[:5]} are outside the vocabulary "
                         f"[0, {cfg.vocab_size}); map them through the tokenizer first")


def _check_per_row(name: str, x, b: int, what: str) -> None:
    """`x` is an integer array with one value per row, `[B]`."""
    if jnp.shape(x) != (b,) or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise ValueError(f"{name}: {jnp.result_type(x)}{list(jnp.shape(x))}; expected int32 [B={b}], {what}")


def check_chunk(cfg: ModelConfig, state: State, tokens, n_valid) -> None:
    """A chunk `tokens [B, S]` (`n_valid [B]` real) written at each row's length fits the state."""
    if not isinstance(state, State):
        raise ValueError(f"state: expected a csa2.state.State, got {type(state).__name__}; build it with init_state")
    check_token_ids(cfg, tokens, n_valid)
    b, s = jnp.shape(tokens)
    if b != state.batch:
        raise ValueError(f"tokens.shape={jnp.shape(tokens)}: expected [B={state.batch}, S] (the state's batch)")
    if n_valid is not None:
        _check_per_row("n_valid", n_valid, b, "one count per row")
    cap = capacity(cfg, state)
    if s > cap:
        raise ValueError(f"chunk length {s} exceeds the state capacity {cap}; split the prompt or allocate a "
                         "larger state")
    start = concrete(state.length)
    counts = np.full(b, s) if n_valid is None else concrete(n_valid)
    if start is None or counts is None:
        return
    if (counts < 0).any() or (counts > s).any():
        raise ValueError(f"n_valid={counts.tolist()}: each row needs 0 ≤ n_valid ≤ S={s}")
    if (start + counts > cap).any():
        raise ValueError(f"positions up to {int((start + counts).max()) - 1} are beyond the state capacity {cap} "
                         f"(state.length={start.tolist()}); allocate a larger state")


def check_extend(cfg: ModelConfig, state: State, tokens, n_valid, extend) -> None:
    """Each row's chunk `[length, length + n_valid)` lies inside its extend `[start, end)` (rows that
    receive tokens, when the values are concrete), and an encoder replay's hit is a prefix of the prompt
    that the replay rebuilds whole windows of."""
    if extend is None:
        return
    if not isinstance(extend, Extend):
        raise ValueError(f"extend: expected a csa2.replay.Extend(start, end) or None, got {type(extend).__name__}")
    b, s = jnp.shape(tokens)
    for name in ("start", "end"):
        _check_per_row(f"extend.{name}", getattr(extend, name), b, "one position per row")
    start, end, length = concrete(extend.start), concrete(extend.end), concrete(state.length)
    counts = np.full(b, s) if n_valid is None else concrete(n_valid)
    if any(x is None for x in (start, end, length, counts)):
        return
    fed = counts > 0
    bad = fed & ((start < 0) | (length < start) | (length + counts > end))
    if bad.any():
        raise ValueError(f"extend=[{start.tolist()}, {end.tolist()}): the chunks [length, length + n_valid) = "
                         f"[{length.tolist()}, {(length + counts).tolist()}) of rows {np.flatnonzero(bad).tolist()} "
                         "lie outside it; pass the positions of the whole prompt, e.g. Extend.cold(prompt_lengths)")
    if extend.hit is not None:
        _check_hit(cfg, extend, b)


def _check_hit(cfg: ModelConfig, extend: Extend, b: int) -> None:
    _check_per_row("extend.hit", extend.hit, b, "one prefix length per row")
    start, end, hit = concrete(extend.start), concrete(extend.end), concrete(extend.hit)
    if any(x is None for x in (start, end, hit)):
        return
    outside = (hit < start) | (hit > end)
    if outside.any():
        raise ValueError(f"extend.hit={hit.tolist()}: rows {np.flatnonzero(outside).tolist()} have a cached prefix "
                         f"outside their extend [{start.tolist()}, {end.tolist()}): the prefix must end inside the "
                         "prompt (a prefix longer than the prompt cannot be resumed: look up a shorter one)")
    short = (start < hit) & (hit - start < np.minimum(hit, cfg.sliding_window))
    if short.any():
        raise ValueError(f"extend.start={start.tolist()}, extend.hit={hit.tolist()}: rows "
                         f"{np.flatnonzero(short).tolist()} replay fewer than min(hit, sliding_window="
                         f"{cfg.sliding_window}) prefix tokens, so their encoder windows stay incomplete; plan the "
                         "extend with Extend.replaying")
