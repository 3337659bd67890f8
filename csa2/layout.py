"""The layer plan: each layer's role and sources (SPEC §2), and how the plan is stacked (DESIGN §5).

- `layer_plan`: one `LayerSpec` per layer.
- `kv_stacks`: KV sources of the same compress ratio have Global KV of the same shape, so the state
  keeps them stacked (one buffer per ratio); a source's address is its (stack, slot).
- `layer_groups`: the plan as repeating cycles of layers (`[Full + 5 Reuse]` in the encoder,
  `[Reindex + 3 Reuse]` in the decoder). Each `Group` is one body scanned over its iterations,
  and each body is a few `Run`s of identical layers, themselves scanned. Parameters are stacked the
  same way (`[iterations, layers of the run, ...]`), so the compiled program holds one copy of
  each distinct layer body, whatever the depth. Engram does not split a group: its parameters live
  apart (parameter layout 3) and a body applies the Engram layers it covers by index. In layout 2 each
  Engram layer was a group of its own (`layout=2`, kept to read older checkpoints and to draw
  parameters as before, `csa2.relayout`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from csa2.config import ModelConfig

Role = Literal["swa", "full", "reindex", "reuse"]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer's place in the CSA2 schedule.

    `kv_source` / `index_source` are the layers whose Main KV / top-k this layer reads
    (None for SWA layers). `uses_candidates`: a Reindex layer that scores only inside the
    candidate pool published by the candidate source of its group (SPEC §5).
    """

    index: int
    role: Role
    ratio: int
    kv_source: int | None
    index_source: int | None
    is_encoder: bool
    has_engram: bool
    uses_candidates: bool
    is_candidate_source: bool

    @property
    def compresses(self) -> bool:
        """Whether the layer writes Global KV: a Full layer compresses its own input first (SPEC §4)."""
        return self.kv_source is not None and self.role == "full"


def _latest(sources: tuple[int, ...], layer: int) -> int | None:
    return max((s for s in sources if s <= layer), default=None)


def layer_plan(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    """Roles per SPEC §2: ratio 0 → SWA; KV source → Full; other index source → Reindex; else Reuse."""
    plan = []
    cand = cfg.candidate_source_layer_id if cfg.candidates_enabled else None
    for i, ratio in enumerate(cfg.compress_ratios):
        if ratio == 0:
            role, kv, idx = "swa", None, None
        else:
            kv = _latest(cfg.kv_source_layer_ids, i)
            idx = _latest(cfg.index_source_layer_ids, i)
            role = "full" if i == kv else "reindex" if i == idx else "reuse"
        uses_candidates = (role == "reindex" and cand is not None and cand < i
                           and _latest(cfg.kv_source_layer_ids, cand) == kv)
        plan.append(LayerSpec(
            index=i, role=role, ratio=ratio, kv_source=kv, index_source=idx,
            is_encoder=i < cfg.first_decoder_layer, has_engram=i in cfg.engram_layer_ids,
            uses_candidates=uses_candidates, is_candidate_source=i == cand,
        ))
    return tuple(plan)


def format_plan(plan: tuple[LayerSpec, ...]) -> str:
    """A fixed-width table of the plan, one row per layer."""
    head = f"{'layer':>5} {'role':<8} {'ratio':>5} {'kv_src':>6} {'idx_src':>7} {'part':<8} notes"
    rows = [head, "-" * len(head)]
    for s in plan:
        notes = [n for n, on in (("engram", s.has_engram), ("candidate-source", s.is_candidate_source),
                                  ("scores-candidates", s.uses_candidates)) if on]
        dash = lambda v: "-" if v is None else str(v)  # noqa: E731
        rows.append(f"{s.index:>5} {s.role:<8} {s.ratio:>5} {dash(s.kv_source):>6} {dash(s.index_source):>7} "
                    f"{'encoder' if s.is_encoder else 'decoder':<8} {' '.join(notes)}")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# Stacked Global KV

@functools.lru_cache(maxsize=None)
def kv_stacks(cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """KV source layers grouped by compress ratio, in order of first appearance: one stacked Global KV each."""
    stacks: dict[int, list[int]] = {}
    for src in cfg.kv_source_layer_ids:
        stacks.setdefault(cfg.compress_ratios[src], []).append(src)
    return tuple(tuple(v) for v in stacks.values())


def kv_address(cfg: ModelConfig, source: int) -> tuple[int, int]:
    """(stack, slot) of KV source layer `source` in `kv_stacks(cfg)`."""
    for stack, sources in enumerate(kv_stacks(cfg)):
        if source in sources:
            return stack, sources.index(source)
    raise ValueError(f"kv_address: layer {source} is not a KV source; KV sources are {cfg.kv_source_layer_ids}")


# ---------------------------------------------------------------------------------------------
# Repeating groups of layers

@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive layers of one structure inside a group iteration, stacked and scanned as one body.

    `offset`: first layer of the run relative to the first layer of its iteration; `spec`: the run's
    first layer in iteration 0 (the others differ only in index and sources).
    """

    offset: int
    count: int
    spec: LayerSpec


@dataclasses.dataclass(frozen=True)
class Group:
    """`count` iterations of the same cycle of `period` layers starting at layer `first` (DESIGN §5)."""

    first: int
    count: int
    period: int
    runs: tuple[Run, ...]

    @property
    def end(self) -> int:
        return self.first + self.count * self.period

    def layer(self, iteration: int, offset: int) -> int:
        return self.first + iteration * self.period + offset


LAYOUT = 3  # the parameter layout `layer_groups` stacks by default (`csa2.checkpoints.native`)
LAYOUTS = (2, LAYOUT)


def _structure(spec: LayerSpec, layout: int) -> tuple:
    """What one traced layer body depends on. Engram is not part of it in layout 3: its parameters live apart from
    the layers' (their tables differ in rows from layer to layer), and a body applies the Engram layers it covers
    by index (`csa2.stack`). In layout 2 an Engram layer held its own, so it only matched itself."""
    body = (spec.role, spec.ratio, spec.is_encoder, spec.uses_candidates, spec.is_candidate_source)
    return body if layout == LAYOUT else (*body, spec.index if spec.has_engram else None)


def _cycles(plan: tuple[LayerSpec, ...]) -> list[list[LayerSpec]]:
    """The plan cut before every layer that selects for itself: SWA, Full and Reindex layers each start a cycle."""
    cycles: list[list[LayerSpec]] = []
    for spec in plan:
        if spec.role == "reuse" and cycles:
            cycles[-1].append(spec)
        else:
            cycles.append([spec])
    return cycles


def _runs(cycle: list[LayerSpec], layout: int) -> tuple[Run, ...]:
    runs: list[Run] = []
    for offset, spec in enumerate(cycle):
        if runs and _structure(runs[-1].spec, layout) == _structure(spec, layout):
            runs[-1] = dataclasses.replace(runs[-1], count=runs[-1].count + 1)
        else:
            runs.append(Run(offset, 1, spec))
    return tuple(runs)


def _signature(group_runs: tuple[Run, ...], layout: int) -> tuple:
    return tuple((r.offset, r.count, _structure(r.spec, layout)) for r in group_runs)


@functools.lru_cache(maxsize=None)
def layer_groups(cfg: ModelConfig, layout: int = LAYOUT) -> tuple[Group, ...]:
    """The plan as groups: consecutive cycles with the same runs of the same structures merge into one group.
    `layout`: the parameter layout whose stacking is wanted (module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: parameters are stacked in one of the layouts {LAYOUTS}")
    groups: list[Group] = []
    for cycle in _cycles(layer_plan(cfg)):
        runs = _runs(cycle, layout)
        last = groups[-1] if groups else None
        if (last is not None and last.period == len(cycle)
                and _signature(last.runs, layout) == _signature(runs, layout)):
            groups[-1] = dataclasses.replace(last, count=last.count + 1)
        else:
            groups.append(Group(cycle[0].index, 1, len(cycle), runs))
    return tuple(groups)


@functools.lru_cache(maxsize=None)
def addresses(cfg: ModelConfig, layout: int = LAYOUT) -> dict[int, tuple[int, int, int, int]]:
    """Layer → where its parameters sit in the stacking of `layout`: (group, iteration, run, layer of the run)."""
    out = {}
    for gi, group in enumerate(layer_groups(cfg, layout)):
        for ri, run in enumerate(group.runs):
            for it in range(group.count):
                for j in range(run.count):
                    out[group.layer(it, run.offset + j)] = (gi, it, ri, j)
    return out


def format_groups(cfg: ModelConfig) -> str:
    """One line per group of `layer_groups(cfg)`: its layers, iterations, the runs of its body and its Engram
    layers."""
    lines = []
    for g in layer_groups(cfg):
        body = ", ".join(r.spec.role + (f" ×{r.count}" if r.count > 1 else "") for r in g.runs)
        engram = [layer for layer in cfg.engram_layer_ids if g.first <= layer < g.end]
        lines.append(f"  layers {g.first:>2}–{g.end - 1:<2}  {g.count} × [{body}]"
                     + (f"  Engram at {', '.join(map(str, engram))}" if engram else ""))
    return "\n".join(lines)
