"""The layer plan: each layer's role and sources (SPEC §2), and how the plan is stacked (DESIGN §5).

- `layer_plan`: one `LayerSpec` per layer.
- `kv_stacks`: KV sources of the same compress ratio have Global KV of the same shape, so the state
  keeps them stacked (one buffer per ratio); a source's address is its (stack, slot).
- `layer_groups`: the plan as repeating cycles of layers (`[Full + 5 Reuse]` in the encoder,
  `[Reindex + 3 Reuse]` in the decoder). Each `Group` is one body scanned over its iterations,
  and each body is a few `Run`s of identical layers, themselves scanned. Parameters are stacked the
  same way (`[iterations, layers of the run, ...]`), so the compiled program holds one copy of
  each distinct layer body, whatever the depth.
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


def _structure(spec: LayerSpec) -> tuple:
    """What one traced layer body depends on. Engram hashing constants are per layer, so an Engram
    layer only matches itself."""
    return (spec.role, spec.ratio, spec.is_encoder, spec.uses_candidates, spec.is_candidate_source,
            spec.index if spec.has_engram else None)


def _cycles(plan: tuple[LayerSpec, ...]) -> list[list[LayerSpec]]:
    """The plan cut before every layer that selects for itself: SWA, Full and Reindex layers each start a cycle."""
    cycles: list[list[LayerSpec]] = []
    for spec in plan:
        if spec.role == "reuse" and cycles:
            cycles[-1].append(spec)
        else:
            cycles.append([spec])
    return cycles


def _runs(cycle: list[LayerSpec]) -> tuple[Run, ...]:
    runs: list[Run] = []
    for offset, spec in enumerate(cycle):
        if runs and _structure(runs[-1].spec) == _structure(spec):
            runs[-1] = dataclasses.replace(runs[-1], count=runs[-1].count + 1)
        else:
            runs.append(Run(offset, 1, spec))
    return tuple(runs)


def _signature(group_runs: tuple[Run, ...]) -> tuple:
    return tuple((r.offset, r.count, _structure(r.spec)) for r in group_runs)


@functools.lru_cache(maxsize=None)
def layer_groups(cfg: ModelConfig) -> tuple[Group, ...]:
    """The plan as groups: consecutive cycles with the same runs of the same structures merge into one group."""
    groups: list[Group] = []
    for cycle in _cycles(layer_plan(cfg)):
        runs = _runs(cycle)
        last = groups[-1] if groups else None
        if last is not None and last.period == len(cycle) and _signature(last.runs) == _signature(runs):
            groups[-1] = dataclasses.replace(last, count=last.count + 1)
        else:
            groups.append(Group(cycle[0].index, 1, len(cycle), runs))
    return tuple(groups)


def format_groups(groups: tuple[Group, ...]) -> str:
    """One line per group: its layers, iterations and the runs of its body."""
    lines = []
    for g in groups:
        body = ", ".join(f"{r.spec.role}{'+engram' if r.spec.has_engram else ''}"
                         + (f" ×{r.count}" if r.count > 1 else "") for r in g.runs)
        lines.append(f"  layers {g.first:>2}–{g.end - 1:<2}  {g.count} × [{body}]")
    return "\n".join(lines)
