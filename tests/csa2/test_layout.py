"""Tests for csa2.layout: the layer plan of SPEC §2 written out row by row, the stacked Global KV
addresses and the repeating layer groups (DESIGN §5)."""

import pytest

from csa2.layout import (
    Group,
    LayerSpec,
    Run,
    addresses,
    format_groups,
    format_plan,
    kv_address,
    kv_stacks,
    layer_groups,
    layer_plan,
)
from csa2.presets import preset

FIELDS = ("role", "ratio", "kv_source", "index_source", "is_encoder", "has_engram", "uses_candidates",
          "is_candidate_source")
T, F = True, False

# SPEC §2 for the released schedule. Columns: FIELDS.
V41_PLAN = [
    ("swa", 0, None, None, T, F, F, F),  # 0
    ("swa", 0, None, None, T, T, F, F),  # 1  engram
    ("full", 2, 2, 2, T, F, F, F),  # 2
    ("reuse", 2, 2, 2, T, F, F, F),  # 3
    ("reuse", 2, 2, 2, T, F, F, F),  # 4
    ("reuse", 2, 2, 2, T, F, F, F),  # 5
    ("reuse", 2, 2, 2, T, F, F, F),  # 6
    ("reuse", 2, 2, 2, T, F, F, F),  # 7
    ("full", 2, 8, 8, T, F, F, F),  # 8
    ("reuse", 2, 8, 8, T, F, F, F),  # 9
    ("reuse", 2, 8, 8, T, F, F, F),  # 10
    ("reuse", 2, 8, 8, T, F, F, F),  # 11
    ("reuse", 2, 8, 8, T, F, F, F),  # 12
    ("reuse", 2, 8, 8, T, F, F, F),  # 13
    ("full", 2, 14, 14, T, T, F, F),  # 14 engram
    ("reuse", 2, 14, 14, T, F, F, F),  # 15
    ("reuse", 2, 14, 14, T, F, F, F),  # 16
    ("reuse", 2, 14, 14, T, F, F, F),  # 17
    ("reuse", 2, 14, 14, T, F, F, F),  # 18
    ("reuse", 2, 14, 14, T, F, F, F),  # 19
    ("full", 1, 20, 20, F, F, F, T),  # 20 candidate source
    ("reuse", 1, 20, 20, F, F, F, F),  # 21
    ("reuse", 1, 20, 20, F, F, F, F),  # 22
    ("reuse", 1, 20, 20, F, F, F, F),  # 23
    ("reindex", 1, 20, 24, F, F, T, F),  # 24
    ("reuse", 1, 20, 24, F, F, F, F),  # 25
    ("reuse", 1, 20, 24, F, F, F, F),  # 26
    ("reuse", 1, 20, 24, F, F, F, F),  # 27
    ("reindex", 1, 20, 28, F, F, T, F),  # 28
    ("reuse", 1, 20, 28, F, F, F, F),  # 29
    ("reuse", 1, 20, 28, F, F, F, F),  # 30
    ("reuse", 1, 20, 28, F, F, F, F),  # 31
    ("reindex", 1, 20, 32, F, F, T, F),  # 32
    ("reuse", 1, 20, 32, F, F, F, F),  # 33
    ("reuse", 1, 20, 32, F, F, F, F),  # 34
    ("reuse", 1, 20, 32, F, F, F, F),  # 35
    ("reindex", 1, 20, 36, F, F, T, F),  # 36
    ("reuse", 1, 20, 36, F, F, F, F),  # 37
    ("reuse", 1, 20, 36, F, F, F, F),  # 38
    ("reuse", 1, 20, 36, F, F, F, F),  # 39
]

MINI_PLAN = [
    ("swa", 0, None, None, T, F, F, F),  # 0
    ("full", 2, 1, 1, T, T, F, F),  # 1 engram
    ("reuse", 2, 1, 1, T, F, F, F),  # 2
    ("reuse", 2, 1, 1, T, F, F, F),  # 3
    ("full", 1, 4, 4, F, F, F, T),  # 4 candidate source
    ("reuse", 1, 4, 4, F, F, F, F),  # 5
    ("reindex", 1, 4, 6, F, F, T, F),  # 6
    ("reuse", 1, 4, 6, F, F, F, F),  # 7
]


def _check(plan, expected):
    assert len(plan) == len(expected)
    for i, (spec, row) in enumerate(zip(plan, expected)):
        assert isinstance(spec, LayerSpec)
        assert spec.index == i
        assert tuple(getattr(spec, f) for f in FIELDS) == row, f"layer {i}"


def test_v41_flash_plan_table(v41_flash):
    _check(layer_plan(v41_flash), V41_PLAN)


def test_v41_flash_plan_summary(v41_flash):
    """Cross-check of the table against SPEC §2's prose."""
    plan = layer_plan(v41_flash)
    by_role = {r: [s.index for s in plan if s.role == r] for r in ("swa", "full", "reindex", "reuse")}
    assert by_role["swa"] == [0, 1]
    assert by_role["full"] == [2, 8, 14, 20]
    assert by_role["reindex"] == [24, 28, 32, 36]
    assert len(by_role["reuse"]) == 30
    assert [s.index for s in plan if s.is_encoder] == list(range(20))
    assert [s.index for s in plan if s.has_engram] == [1, 14]
    assert [s.index for s in plan if s.uses_candidates] == [24, 28, 32, 36]
    for s in plan:
        if s.role == "reuse":
            assert s.kv_source == max(k for k in (2, 8, 14, 20) if k <= s.index)
            assert s.index_source == max(k for k in (2, 8, 14, 20, 24, 28, 32, 36) if k <= s.index)


def test_mini_plan_table(mini):
    _check(layer_plan(mini), MINI_PLAN)


def test_tiny_has_the_released_plan(tiny, v41_flash):
    assert layer_plan(tiny) == layer_plan(v41_flash)
    _check(layer_plan(tiny), V41_PLAN)


@pytest.mark.parametrize("name,reindex", [("v41_flash", [24, 28, 32, 36]), ("mini", [6])])
def test_disabled_candidate_source(name, reindex):
    cfg = preset(name).replace(candidate_source_layer_id=-1)
    plan = layer_plan(cfg)
    assert [s.index for s in plan if s.role == "reindex"] == reindex
    assert not any(s.uses_candidates for s in plan)
    assert not any(s.is_candidate_source for s in plan)
    # everything else is unchanged
    base = layer_plan(preset(name))
    for a, b in zip(plan, base):
        assert (a.role, a.ratio, a.kv_source, a.index_source, a.is_encoder, a.has_engram) == \
               (b.role, b.ratio, b.kv_source, b.index_source, b.is_encoder, b.has_engram)


def test_candidate_source_at_a_reindex_layer_constrains_only_later_reindex_layers(v41_flash):
    plan = layer_plan(v41_flash.replace(candidate_source_layer_id=28))
    assert [s.index for s in plan if s.is_candidate_source] == [28]
    assert [s.index for s in plan if s.uses_candidates] == [32, 36]
    assert plan[28].role == "reindex" and not plan[28].uses_candidates


def test_reindex_in_another_kv_group_does_not_use_candidates(v41_flash):
    """Candidates index one group's Global KV; a Reindex layer of a different KV group cannot use them."""
    cfg = v41_flash.replace(
        index_source_layer_ids=(2, 5, 8, 14, 20, 24, 28, 32, 36))
    plan = layer_plan(cfg)
    assert plan[5].role == "reindex" and plan[5].kv_source == 2 and plan[5].index_source == 5
    assert not plan[5].uses_candidates  # candidate source 20 comes later and is in another group
    assert [s.index for s in plan if s.uses_candidates] == [24, 28, 32, 36]


def test_reindex_after_candidate_source_but_in_a_later_kv_group_does_not_use_candidates(v41_flash):
    """A second ratio-1 KV source (30) starts a new group: its Reindex layers cannot score 20's pool."""
    cfg = v41_flash.replace(
        kv_source_layer_ids=(2, 8, 14, 20, 30), index_source_layer_ids=(2, 8, 14, 20, 24, 28, 30, 32, 36))
    plan = layer_plan(cfg)
    assert plan[30].role == "full" and plan[32].role == "reindex" and plan[32].kv_source == 30
    assert [s.index for s in plan if s.uses_candidates] == [24, 28]
    assert plan[29].kv_source == 20 and plan[39].kv_source == 30 and plan[39].index_source == 36


def test_plan_follows_a_changed_schedule(tiny):
    """Roles are derived, not hard-coded: move the decoder boundary and sources."""
    cfg = tiny.replace(
        compress_ratios=(0,) + (2,) * 9 + (1,) * 30,
        kv_source_layer_ids=(1, 10), index_source_layer_ids=(1, 10, 15),
        candidate_source_layer_id=10, engram_layer_ids=(3,))
    plan = layer_plan(cfg)
    assert [s.role for s in plan[:2]] == ["swa", "full"]
    assert [s.index for s in plan if s.role == "full"] == [1, 10]
    assert [s.index for s in plan if s.role == "reindex"] == [15]
    assert [s.index for s in plan if s.is_encoder] == list(range(10))
    assert [s.index for s in plan if s.has_engram] == [3]
    assert plan[15].uses_candidates and plan[10].is_candidate_source
    assert plan[39].kv_source == 10 and plan[39].index_source == 15
    assert plan[9].kv_source == 1 and plan[9].index_source == 1


@pytest.mark.parametrize("name", ["v41_flash", "tiny", "mini"])
def test_format_plan_one_row_per_layer(name):
    cfg = preset(name)
    plan = layer_plan(cfg)
    lines = format_plan(plan).splitlines()
    rows = [line for line in lines if line.strip() and line.split()[0].isdigit()]
    assert len(rows) == cfg.num_hidden_layers
    assert len(lines) == cfg.num_hidden_layers + 2  # header + rule
    for spec, line in zip(plan, rows):
        cols = line.split()
        assert int(cols[0]) == spec.index and cols[1] == spec.role and int(cols[2]) == spec.ratio
        assert cols[3] == ("-" if spec.kv_source is None else str(spec.kv_source))
        assert cols[4] == ("-" if spec.index_source is None else str(spec.index_source))
        assert cols[5] == ("encoder" if spec.is_encoder else "decoder")
        assert ("engram" in cols[6:]) == spec.has_engram
        assert ("candidate-source" in cols[6:]) == spec.is_candidate_source
        assert ("scores-candidates" in cols[6:]) == spec.uses_candidates


def test_layer_spec_is_frozen_and_hashable(mini):
    plan = layer_plan(mini)
    hash(plan)
    with pytest.raises(AttributeError):
        plan[0].role = "full"


# --------------------------------------------------------------------------------------------
# Stacked Global KV

RATIO_3 = dict(compress_ratios=(0, 0) + (2,) * 6 + (3,) * 12 + (1,) * 20)  # sources 2, 8, 14, 20: ratios 2, 3, 3, 1


@pytest.mark.parametrize("name,changes,stacks,addresses", [
    ("mini", {}, ((1,), (4,)), {1: (0, 0), 4: (1, 0)}),
    ("tiny", {}, ((2, 8, 14), (20,)), {2: (0, 0), 8: (0, 1), 14: (0, 2), 20: (1, 0)}),
    ("v41_flash", {}, ((2, 8, 14), (20,)), {2: (0, 0), 8: (0, 1), 14: (0, 2), 20: (1, 0)}),
    ("tiny", RATIO_3, ((2,), (8, 14), (20,)), {2: (0, 0), 8: (1, 0), 14: (1, 1), 20: (2, 0)}),
    # order of first appearance, not of ratio: ratio 1 first, then ratio 2
    ("tiny", dict(compress_ratios=(0, 0) + (1,) * 18 + (2,) * 20, candidate_source_layer_id=-1), ((2, 8, 14), (20,)),
     {2: (0, 0), 8: (0, 1), 14: (0, 2), 20: (1, 0)}),
    ("tiny", dict(compress_ratios=(0, 0) + (1,) * 12 + (2,) * 6 + (1,) * 20), ((2, 8, 20), (14,)),
     {2: (0, 0), 8: (0, 1), 14: (1, 0), 20: (0, 2)}),
])
def test_kv_stacks_and_addresses(name, changes, stacks, addresses):
    cfg = preset(name).replace(**changes)
    assert kv_stacks(cfg) == stacks
    assert {s: kv_address(cfg, s) for s in cfg.kv_source_layer_ids} == addresses
    for s, (k, slot) in addresses.items():
        assert kv_stacks(cfg)[k][slot] == s
        assert len({cfg.compress_ratios[t] for t in kv_stacks(cfg)[k]}) == 1  # one ratio per stack


@pytest.mark.parametrize("layer", [0, 3, 21, 39])
def test_kv_address_rejects_a_layer_that_is_not_a_source(tiny, layer):
    with pytest.raises(ValueError, match=f"layer {layer} is not a KV source"):
        kv_address(tiny, layer)


# --------------------------------------------------------------------------------------------
# Repeating layer groups

# (first layer, iterations, period, runs as (offset, count, role)), written from the plans above.
V41_GROUPS = [
    (0, 2, 1, [(0, 1, "swa")]),  # 0, 1 (Engram at 1)
    (2, 3, 6, [(0, 1, "full"), (1, 5, "reuse")]),  # 2..19: [Full + 5 Reuse] × 3 (Engram at 14)
    (20, 1, 4, [(0, 1, "full"), (1, 3, "reuse")]),  # 20..23: the candidate source + 3 Reuse
    (24, 4, 4, [(0, 1, "reindex"), (1, 3, "reuse")]),  # 24..39: [Reindex + 3 Reuse] × 4
]
# Parameter layout 2: an Engram layer (per-layer hashing constants, and its memory inside it) in a group of its own.
V41_GROUPS_LAYOUT2 = [
    (0, 1, 1, [(0, 1, "swa")]),  # 0
    (1, 1, 1, [(0, 1, "swa")]),  # 1: Engram
    (2, 2, 6, [(0, 1, "full"), (1, 5, "reuse")]),  # 2..13: [Full + 5 Reuse] × 2
    (14, 1, 6, [(0, 1, "full"), (1, 5, "reuse")]),  # 14..19: Full with Engram + 5 Reuse
    *V41_GROUPS[2:],
]
MINI_GROUPS = [
    (0, 1, 1, [(0, 1, "swa")]),  # 0
    (1, 1, 3, [(0, 1, "full"), (1, 2, "reuse")]),  # 1..3: Full (Engram at 1) + 2 Reuse
    (4, 1, 2, [(0, 1, "full"), (1, 1, "reuse")]),  # 4, 5: the candidate source + Reuse
    (6, 1, 2, [(0, 1, "reindex"), (1, 1, "reuse")]),  # 6, 7
]


@pytest.mark.parametrize("name,layout,expected", [
    ("v41_flash", 3, V41_GROUPS), ("tiny", 3, V41_GROUPS), ("mini", 3, MINI_GROUPS),
    ("v41_flash", 2, V41_GROUPS_LAYOUT2), ("mini", 2, MINI_GROUPS),
])
def test_layer_groups_hand_written(name, layout, expected):
    cfg = preset(name)
    plan = layer_plan(cfg)
    groups = layer_groups(cfg, layout)
    assert all(isinstance(g, Group) and all(isinstance(r, Run) for r in g.runs) for g in groups)
    got = [(g.first, g.count, g.period, [(r.offset, r.count, r.spec.role) for r in g.runs]) for g in groups]
    assert got == expected
    for g in groups:
        assert g.end == g.first + g.count * g.period
        for r in g.runs:
            assert r.spec == plan[g.first + r.offset]  # the run's first layer in iteration 0


def test_layer_groups_refuse_an_unknown_layout(mini):
    with pytest.raises(ValueError, match=r"layout=1: parameters are stacked in one of the layouts \(2, 3\)"):
        layer_groups(mini, 1)


def test_layer_groups_details_v41_flash(v41_flash):
    groups = layer_groups(v41_flash)
    assert groups[2].runs[0].spec.is_candidate_source
    assert all(r.spec.is_encoder for g in groups[:2] for r in g.runs)
    assert not any(r.spec.is_encoder for g in groups[2:] for r in g.runs)
    assert groups[3].runs[0].spec.uses_candidates
    assert [groups[3].layer(i, 0) for i in range(4)] == [24, 28, 32, 36]
    assert groups[1].layer(1, 3) == 11 and groups[1].layer(2, 0) == 14 and groups[1].end == 20
    assert format_groups(v41_flash).splitlines()[:2] == [
        "  layers  0–1   2 × [swa]  Engram at 1", "  layers  2–19  3 × [full, reuse ×5]  Engram at 14"]


@pytest.mark.parametrize("layout", [2, 3])
@pytest.mark.parametrize("name,changes", [
    ("v41_flash", {}), ("tiny", {}), ("mini", {}), ("demo", {}),
    ("v41_flash", dict(candidate_source_layer_id=-1)),
    ("tiny", RATIO_3),
    ("tiny", dict(compress_ratios=(0,) + (2,) * 9 + (1,) * 30, kv_source_layer_ids=(1, 10),
                  index_source_layer_ids=(1, 10, 15), candidate_source_layer_id=10, engram_layer_ids=(3,))),
])
def test_layer_groups_cover_every_layer_once_in_order(name, changes, layout):
    """Walking groups → iterations → runs → layers visits layers 0 … L−1 in order, each exactly once, and
    every layer has its run's structure (role, ratio, part, candidates; in layout 2 also Engram)."""
    cfg = preset(name).replace(**changes)
    plan = layer_plan(cfg)
    groups = layer_groups(cfg, layout)
    order = []
    for gi, g in enumerate(groups):
        assert [r.offset for r in g.runs] == [sum(r.count for r in g.runs[:i]) for i in range(len(g.runs))]
        assert sum(r.count for r in g.runs) == g.period
        for i in range(g.count):
            for ri, r in enumerate(g.runs):
                for j in range(r.count):
                    layer = g.layer(i, r.offset + j)
                    order.append(layer)
                    assert addresses(cfg, layout)[layer] == (gi, i, ri, j), layer
                    spec = plan[layer]
                    structure = (spec.role, spec.ratio, spec.is_encoder, spec.uses_candidates,
                                 spec.is_candidate_source)
                    assert structure == (r.spec.role, r.spec.ratio, r.spec.is_encoder, r.spec.uses_candidates,
                                         r.spec.is_candidate_source), layer
                    if layout == 2:
                        assert spec.has_engram == r.spec.has_engram and (
                            not spec.has_engram or g.count == r.count == 1), layer
    assert order == list(range(cfg.num_hidden_layers))
    assert [g.first for g in groups] == [0] + [g.end for g in groups[:-1]]
    assert groups[-1].end == cfg.num_hidden_layers
