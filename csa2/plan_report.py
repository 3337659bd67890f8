"""`python -m csa2 inspect`: the layer plan and a memory table, computed without allocating."""

from __future__ import annotations

import argparse

from csa2.layout import format_groups, format_plan, layer_groups, layer_plan
from csa2.presets import PRESETS, preset
from csa2.state import CACHE_FORMATS, abstract_state, kv_bytes_per_token, state_bytes, swa_bytes_per_sequence


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def inspect_report(name: str, context: int, batch: int = 1, cache_format: str = "fp4") -> str:
    """The plan of preset `name` and its state memory at `context` tokens (SPEC §2, §8)."""
    cfg = preset(name)
    state = abstract_state(cfg, batch, context, cache_format)
    parts = state_bytes(state)
    per_token = kv_bytes_per_token(cfg, cache_format)
    roles = [s.role for s in layer_plan(cfg)]
    counts = ", ".join(f"{r} ×{roles.count(r)}" for r in ("swa", "full", "reindex", "reuse"))
    lines = [
        f"preset {name}: {cfg.num_hidden_layers} layers ({counts}), hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads × {cfg.head_dim}, vocab {cfg.vocab_size}",
        f"encoder layers 0–{cfg.first_decoder_layer - 1}, "
        f"decoder layers {cfg.first_decoder_layer}–{cfg.num_hidden_layers - 1}; "
        f"KV sources {list(cfg.kv_source_layer_ids)}, index sources {list(cfg.index_source_layer_ids)}, "
        f"candidate source {cfg.candidate_source_layer_id}, Engram {list(cfg.engram_layer_ids)}",
        "",
        format_plan(layer_plan(cfg)),
        "",
        f"layer groups ({len(layer_groups(cfg))} scanned bodies; each body's runs of identical layers scanned in turn)",
        format_groups(cfg),
        "",
        f"memory ({cache_format} cache, batch {batch}, context {context:,} tokens; "
        "shapes from jax.eval_shape(init_state))",
        f"  Global KV per token            {per_token:>14,.1f} B",
        f"  Global KV at context           {_mb(parts['global_kv']):>16}",
        f"  SWA rings, W slots (SPEC §8)   {_mb(batch * swa_bytes_per_sequence(cfg, cache_format)):>16}",
        f"  SWA rings, W + max_draft slots {_mb(parts['swa']):>16}",
        f"  compressor tails               {_mb(parts['tails']):>16}",
        f"  DSpark context windows         {_mb(parts['draft']):>16}",
        f"  history, accept, length, floor "
        f"{_mb(parts['tokens'] + parts['accept'] + parts['length'] + parts['floor']):>16}",
        f"  total state                    {_mb(parts['total']):>16}",
    ]
    return "\n".join(lines)


def add_command(sub: argparse._SubParsersAction) -> None:
    """Register `inspect` on the `python -m csa2` command line (`csa2.cli`)."""
    p = sub.add_parser("inspect", help="print the layer plan and the state memory table")
    p.add_argument("--preset", default="v41_flash", choices=PRESETS)
    p.add_argument("--context", type=int, default=1 << 20, help="tokens per row (capacity)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--format", default="fp4", choices=CACHE_FORMATS, dest="cache_format")
    p.set_defaults(run=lambda args: print(inspect_report(args.preset, args.context, args.batch, args.cache_format)))
