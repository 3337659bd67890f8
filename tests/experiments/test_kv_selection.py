"""The KV-selection measures (`experiments.kv_selection`) on hand cases with known answers, and the notebook's
committed results; the policies themselves run in `tests/csa2/test_selection*.py` and the whole table in the
notebook's fast run."""

import nbformat
import numpy as np
import pytest

from csa2.layout import layer_plan
from csa2.presets import preset
from experiments import kv_selection as kv, ledger, results
from infer import stats
from research import selection
from research.probe import Probe
from research.probe_stats import Summary
from tests.research.host_summary import summary

MINI = preset("mini")  # layer 0 SWA; 1–3 ratio 2; 4–7 ratio 1; index_topk 16


def _probe(mass: np.ndarray, topk: np.ndarray) -> Summary:
    """The statistics [L, B, S, ·] of MINI with the given mass and reads on every layer."""
    L = MINI.num_hidden_layers
    record = Probe(mass=np.broadcast_to(mass, (L, *mass.shape)), topk=np.broadcast_to(topk, (L, *topk.shape)),
                   scan=np.full((L, *topk.shape), -1), pool=np.full((L, *topk.shape[:2], 0), -1))
    return summary(MINI, record)


def test_policies_cover_every_name():
    found = kv.policies()
    assert tuple(found) == kv.NAMES and found["csa2"] is None
    assert [found[n].evicts for n in kv.NAMES[1:]] == [False, True, True, True, True, False]


def test_needle_span_finds_the_answer_digits():
    prompt = np.array([9, 1, 2, 3, 4, 1, 2, 5])
    assert kv.needle_span(prompt, np.array([1, 2, 5])) == (5, 8)
    assert kv.needle_span(prompt, np.array([1, 2])) == (1, 3)  # the first occurrence
    with pytest.raises(ValueError, match="does not occur"):
        kv.needle_span(prompt, np.array([7, 7]))


def test_retrieval_examples_hold_their_needle_before_the_question():
    length, depths = 160, (0.2, 0.8)
    for keys in (1, 2):
        (tokens, answers), = kv.retrieval_examples(length, depths, 1, keys=keys)
        assert tokens.shape == (2, length + 4) and answers.shape == (2, 5)
        np.testing.assert_array_equal(tokens[:, length:], answers[:, :4])  # teacher forcing
        spans = [kv.needle_span(row[:length - 1], a) for row, a in zip(tokens, answers)]
        assert spans[0][0] < spans[1][0]  # depth 0.2 before depth 0.8


def test_needle_reads_counts_layers_and_answer_steps_that_read_the_needle():
    """Needle at tokens [8, 10): ratio-1 entries 8, 9; ratio-2 entry 4. Two answer steps from start 12."""
    b, s, k = 1, 14, 16
    topk = np.full((b, s, k), -1)
    topk[0, 12, 0] = 9  # step 12 reads entry 9: a hit on ratio-1 layers only
    topk[0, 13, 0] = 4  # step 13 reads entry 4: a hit on ratio-2 layers only
    rec = _probe(np.zeros((b, s, s)), topk)
    # Every Global layer (ratio 1 at step 12, ratio 2 at step 13) reads the needle at one of its two steps.
    np.testing.assert_allclose(kv.needle_reads(MINI, rec, [(8, 10)], 12, 2), [0.5])
    np.testing.assert_allclose(kv.needle_reads(MINI, rec, [(0, 2)], 12, 2), [0.0])


def test_answer_scores_and_bits_per_byte():
    logprobs = np.log(np.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [0.2, 0.6, 0.2]]]))  # [1, 3, V=3]
    out = kv.answer_scores(logprobs, np.array([[2, 1]]), 1)  # positions 1, 2 predict 2 then 1: both right
    np.testing.assert_allclose(out["exact"], [1.0])
    np.testing.assert_allclose(out["digits"], [1.0])
    np.testing.assert_allclose(out["bits"], [-(np.log2(0.8) + np.log2(0.6)) / 2])
    out = kv.answer_scores(logprobs, np.array([[0, 1]]), 1)
    np.testing.assert_allclose([out["exact"][0], out["digits"][0]], [0.0, 0.5])
    np.testing.assert_allclose(kv.bits_per_byte(logprobs, np.array([[0, 2, 1]]), 1),
                               [-(np.log2(0.8) + np.log2(0.6)) / 2])
    two_rows = np.concatenate([logprobs, logprobs])
    np.testing.assert_allclose(kv.bits_per_byte(two_rows, np.array([[0, 2, 1], [0, 0, 0]]), 2),
                               [-np.log2(0.6), -np.log2(0.2)])  # one figure per row


def test_budget_use_on_a_hand_record():
    """32 visible entries (ratio 1) at the counted queries, budget 16: an evicting policy reading 16 entries
    holding 0.6 of the mass keeps 16/visible and has lost 0.4; a keeping one keeps all and loses nothing."""
    b, s = 1, 40
    mass = np.zeros((b, s, s))
    mass[..., :10] = 0.06  # 0.6 on entries 0..9
    mass[..., 20:24] = 0.1  # 0.4 on entries 20..23
    topk = np.full((b, s, MINI.index_topk), -1)
    topk[..., :16] = np.arange(16)  # reads 0..15: recall 0.6
    rec = _probe(mass, topk)
    start = 35
    keep = kv.budget_use(MINI, rec, selection.Quest(), start)
    assert all(v.shape == (b,) for v in keep.values())  # one figure per row
    assert {k: v[0] for k, v in keep.items()} == pytest.approx({"reads": 16.0, "distinct": 16.0, "kept": 1.0,
                                                               "recall": 0.6, "lost": 0.0})
    evict = {k: v[0] for k, v in kv.budget_use(MINI, rec, selection.H2O(), start).items()}
    readers = [sp for sp in layer_plan(MINI) if sp.role != "swa"]
    kept = np.mean([16 / ((t + 1) // sp.ratio) for sp in readers for t in range(start, s)
                    if (t + 1) // sp.ratio > MINI.index_topk])
    assert evict == pytest.approx({"reads": 16.0, "distinct": 16.0, "kept": kept, "recall": 0.6, "lost": 0.4})


def test_budget_use_per_head_reads_the_budget_per_head_and_keeps_the_union():
    """Two heads reading 16 entries each, 8 of them in common: 16 read per step (per head), 24 distinct, and an
    evicting policy must keep the 24 that some head still reads; a needle read by one head only is reached."""
    b, s, h = 1, 40, 2
    topk = np.full((b, s, h, MINI.index_topk), -1)
    topk[:, :, 0, :16] = np.arange(16)  # entries 0..15
    topk[:, :, 1, :16] = np.arange(8, 24)  # entries 8..23
    mass = np.full((b, s, s), 1.0 / s)  # some Global mass at every query, so each one counts
    rec = _probe(mass, topk[:, :, 0]).replace(topk=np.broadcast_to(topk, (MINI.num_hidden_layers, *topk.shape)))
    start = 35
    use = {k: v[0] for k, v in kv.budget_use(MINI, rec, selection.H2O(), start).items()}
    readers = [sp for sp in layer_plan(MINI) if sp.role != "swa"]
    kept = np.mean([24 / ((t + 1) // sp.ratio) for sp in readers for t in range(start, s)
                    if (t + 1) // sp.ratio > MINI.index_topk])
    assert (use["reads"], use["distinct"]) == (16.0, 24.0) and use["kept"] == pytest.approx(kept)
    np.testing.assert_array_equal(kv.distinct_reads(np.array([[[[3, 1, -1], [1, 5, -1]]]])), [[3]])
    np.testing.assert_allclose(kv.needle_reads(MINI, rec, [(60, 62)], 36, 2), [0.0])  # entries 60, 61 or 30
    # entries 20, 21 (ratio 1: head 1 only) or 10 (ratio 2): every Global layer reaches it
    np.testing.assert_allclose(kv.needle_reads(MINI, rec, [(20, 22)], 36, 2), [1.0])


def test_the_baselines_choose_per_head_as_published_and_pooled_on_request():
    """`policies()` gives H2O, SnapKV, PyramidKV and Quest one read set per head (their papers); `pooled()` the same
    four, settings and all, with one set their heads share."""
    found, pooled = kv.policies(), kv.pooled()
    assert [found[n].heads(MINI) for n in kv.POOLED] == [MINI.num_attention_heads] * 4
    assert list(pooled) == [f"{n} pooled" for n in kv.POOLED]
    for name in kv.POOLED:
        assert pooled[f"{name} pooled"].heads(MINI) == 1
        assert pooled[f"{name} pooled"] == type(found[name])(**{**vars(found[name]), "per_head": False})


def test_paired_is_the_mean_difference_over_the_same_prompts():
    """`paired`: `row − base` prompt by prompt; a constant gap has a zero-width interval, unlike the two rows'
    own intervals; rows measured on other prompts are refused."""
    rng = np.random.default_rng(0)
    base_digits = rng.random(40)
    base = {"policy": "csa2", "per_prompt": {"passkey": {"digits": base_digits.tolist()}, "bpb": [2.0, 3.0, 4.0]}}
    row = {"policy": "snapkv", "per_prompt": {"passkey": {"digits": (base_digits + 0.1).tolist()},
                                              "bpb": [2.5, 3.0, 4.5]}}
    got = kv.paired(row, base, "passkey_digits")
    assert (got["value"], got["lo"], got["hi"], got["n"]) == (0.1, 0.1, 0.1, 40)
    assert stats.mean_interval(base_digits).hi - stats.mean_interval(base_digits).lo > 0.1
    got = kv.paired(row, base, "bpb")
    assert got["n"] == 3 and got["value"] == pytest.approx(1 / 3, abs=1e-3) and got["lo"] >= 0
    short = {"policy": "h2o", "per_prompt": {"passkey": {"digits": [0.0] * 39}}}
    with pytest.raises(ValueError, match="same prompts"):
        kv.paired(short, base, "passkey_digits")


def test_evaluate_reads_each_row_the_ledger_holds_and_measures_only_what_changed(tmp_path, monkeypatch):
    """With a ledger, a second `evaluate` measures nothing and returns the same rows; a policy's other settings,
    another budget or other text miss and are measured; without a ledger every row is measured."""
    measured = []

    def fake_row(cfg, params, name, policy, depths, passkeys, needles, text, length):
        measured.append((cfg.index_topk, name))
        return {"budget": cfg.index_topk, "policy": name, "bpb": float(cfg.index_topk + len(name))}

    monkeypatch.setattr(kv, "measure_row", fake_row)
    path, params, text = tmp_path / "rows.json", {"w": np.ones(3, np.float32)}, np.zeros((2, 133), np.int32)
    chosen = {"csa2": None, "h2o": selection.H2O()}
    args = dict(length=128, depths=(0.2, 0.8), samples=1, text=text, ledger=path)
    first = kv.evaluate(MINI, params, (8, 16), chosen=chosen, **args)
    assert measured == [(8, "csa2"), (8, "h2o"), (16, "csa2"), (16, "h2o")]
    assert kv.evaluate(MINI, params, (8, 16), chosen=chosen, **args) == first and len(measured) == 4
    kv.evaluate(MINI, params, (8, 32), chosen={**chosen, "h2o": selection.H2O(recent=0.25)}, **args)
    assert measured[4:] == [(8, "h2o"), (32, "csa2"), (32, "h2o")]
    kv.evaluate(MINI, params, (8,), chosen=chosen, **{**args, "text": text + 1})
    kv.evaluate(MINI, {"w": np.zeros(3, np.float32)}, (8,), chosen={"csa2": None}, **args)
    kv.evaluate(MINI, params, (8,), chosen={"csa2": None}, **{**args, "ledger": None})
    assert measured[7:] == [(8, "csa2"), (8, "h2o"), (8, "csa2"), (8, "csa2")]


def test_format_table_has_a_line_per_row_and_states_each_intervals_n():
    rows = [{"budget": 16, "policy": name, **{c: 0.5 for c in kv.COLUMNS}} for name in kv.NAMES]
    text = kv.format_table(rows).splitlines()
    assert len(text) == 1 + len(kv.NAMES) and all(c in text[0] for c in kv.COLUMNS)
    interval = {"value": 0.5, "lo": 0.25, "hi": 0.75, "n": 10, "level": 0.95}
    for r in rows:
        r.update(passkey_intervals={"digits": interval}, bpb_interval={**interval, "n": 5})
    text = kv.format_table(rows, ("reads", "passkey_digits", "bpb")).splitlines()
    assert len(text) == 2 + len(kv.NAMES)
    assert text[1].split()[2:] == ["0.500", "0.500", "[0.250,", "0.750]", "0.500", "[0.250,", "0.750]"]
    assert text[-1] == "intervals: bpb n = 5 at 95%; passkey n = 10 at 95%"
    for r in rows:
        r.update(use_intervals={"recall": {**interval, "n": 64}})
    text = kv.format_table(rows, ("recall", "passkey_digits")).splitlines()
    assert text[1].split()[2:5] == ["0.500", "[0.250,", "0.750]"]
    assert text[-1] == "intervals: budget use n = 64 at 95%; passkey n = 10 at 95%"
    for r in rows:  # one prompt: no intervals, plain figures
        r.update(passkey_intervals=None, bpb_interval=None)
    assert kv.format_table(rows, ("passkey_digits", "bpb")).splitlines()[1].split()[2:] == ["0.500", "0.500"]


def test_the_committed_results_hold_the_policies_definitions():
    """notebooks/kv_selection.json, the notebook's full run: at least 64 held-out-wording prompts per retrieval task
    and every interval on the prompts (or text rows) it was measured on; the policies that evict nothing keep every
    entry and lose no mass, the evicting ones keep less than all; no policy but PyramidKV (per-layer budgets, equal
    on average) reads more entries per step than the budget."""
    got = results.load("kv_selection", fast=False)
    sizes = got["sizes"]
    assert not got["fast"] and sizes["prompts"] >= 64 and sizes["template"] == "held_out"
    assert {(r["budget"], r["policy"]) for r in got["rows"]} == {(b, p) for b in sizes["budgets"] for p in kv.NAMES}
    for r in got["rows"]:
        for column in kv.COLUMNS:
            assert kv.interval_of(r, column)["n"] == (sizes["text_rows"] if column == "bpb" else sizes["prompts"])
        if r["evicts"]:
            assert r["kept"] < 1, r["policy"]
        else:
            assert (r["kept"], r["lost"]) == (1.0, 0.0), r["policy"]
        if r["policy"] != "pyramidkv":
            assert r["reads"] <= r["budget"] + 1e-9, r["policy"]
        heads = got["model"]["heads"] if r["policy"] in kv.POOLED else 1  # the baselines choose per head
        assert r["reads"] - 1e-9 <= r["distinct"] <= heads * r["reads"] + 1e-9, r["policy"]


def test_the_committed_comparisons_are_paired_over_the_tables_prompts():
    """Each policy against csa2 at every budget, and each per-head baseline against itself pooled at the trained
    budget, on the table's prompts (text rows for bits per byte); the pooled rows read one set per layer."""
    got = results.load("kv_selection", fast=False)
    sizes, columns = got["sizes"], ("passkey_digits", "needles_digits", "bpb")
    n = {c: sizes["text_rows"] if c == "bpb" else sizes["prompts"] for c in columns}
    assert {(a["budget"], a["policy"], a["column"]) for a in got["against_csa2"]} == \
        {(b, p, c) for b in sizes["budgets"] for p in kv.NAMES[1:] for c in columns}
    assert {(a["policy"], a["column"]) for a in got["per_head_vs_pooled"]} == {(p, c) for p in kv.POOLED
                                                                               for c in columns}
    for a in got["against_csa2"] + got["per_head_vs_pooled"]:
        assert a["gap"]["n"] == n[a["column"]] and a["gap"]["lo"] <= a["gap"]["value"] <= a["gap"]["hi"], a
    assert [r["policy"] for r in got["pooled_rows"]] == [f"{p} pooled" for p in kv.POOLED]
    for r in got["pooled_rows"]:
        assert r["budget"] == got["model"]["index_topk"]
        assert abs(r["distinct"] - r["reads"]) < 1e-9 and kv.interval_of(r, "passkey_digits")["n"] == sizes["prompts"]


def test_the_committed_results_are_the_ledgers_rows():
    """Every row of notebooks/kv_selection.json is a row the committed ledger holds, as it was measured (less its
    per-prompt values), and the table's time is the sum of its rows' times."""
    got = results.load("kv_selection", fast=False)
    held = [entry["scores"]["row"]["value"] for entry in ledger.load(results.ROOT / "notebooks"
                                                                      / "kv_selection.runs.json").values()]
    for key, total in (("rows", "seconds"), ("pooled_rows", "pooled_seconds")):
        for r in got[key]:
            assert r in [{k: v for k, v in h.items() if k != "per_prompt"} for h in held], (r["budget"], r["policy"])
        assert got[total] == pytest.approx(sum(r["seconds"] for r in got[key]))


def test_the_notebooks_prose_quotes_its_results():
    """The headline figures of the notebook's reading are the saved results, so a re-run that moves them fails
    here until the prose is rewritten."""
    got = results.load("kv_selection", fast=False)
    prose = " ".join(nbformat.read(results.ROOT / "notebooks" / "kv_selection.ipynb",
                                   as_version=4).cells[-1].source.split())
    at = {r["policy"]: r for r in got["rows"] if r["budget"] == 128}
    quoted = [(at["csa2"], "recall"), (at["oracle"], "recall"), (at["snapkv"], "recall"), (at["quest"], "recall"),
              (at["csa2"], "passkey_needle"), (at["oracle"], "passkey_needle"), (at["snapkv"], "passkey_needle")]
    for row, column in quoted:
        assert stats.interval_text(kv.interval_of(row, column), ".3f") in prose, (row["policy"], column)
    gaps = {(a["budget"], a["policy"], a["column"]): a["gap"] for a in got["against_csa2"]}
    for key in [(128, p, "passkey_digits") for p in ("snapkv", "pyramidkv", "quest", "oracle", "h2o")] + \
               [(64, "snapkv", "passkey_digits"), (256, "snapkv", "passkey_digits")] + \
               [(128, p, "needles_digits") for p in ("snapkv", "quest", "h2o")] + \
               [(128, p, "bpb") for p in ("oracle", "snapkv", "quest", "streamingllm")]:
        assert stats.interval_text(gaps[key], "+.3f") in prose, key
    for key in ((128, "h2o", "passkey_digits"), (128, "snapkv", "needles_digits"), (128, "streamingllm", "bpb")):
        assert gaps[key]["lo"] <= 0 <= gaps[key]["hi"], key  # the prose says these hold 0
    pooled = {(a["policy"], a["column"]): a["gap"] for a in got["per_head_vs_pooled"]}
    for key in (("h2o", "passkey_digits"), ("pyramidkv", "needles_digits"), ("snapkv", "passkey_digits")):
        assert stats.interval_text(pooled[key], "+.3f") in prose, key
    assert f"{got['seconds']:,.0f} s for the table" in prose
    assert f"{got['pooled_seconds']:,.0f} s for the pooled" in prose
