"""The layer plan: each layer's role and sources, derived from the config (SPEC §2)."""

from __future__ import annotations

import dataclasses
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
