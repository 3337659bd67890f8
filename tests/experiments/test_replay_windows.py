"""The replay-window measurements behind notebooks/replay_windows.ipynb (SPEC §11)."""

import nbformat
import numpy as np
import pytest

from csa2.replay import EXACT, ReplayPolicy, exact_window, token_layers
from experiments import replay_windows as rw, results
from infer import stats

N = 24
NOTEBOOK = results.ROOT / "notebooks" / "replay_windows.ipynb"


@pytest.fixture(scope="module")
def prompts():
    return np.random.default_rng(0).integers(0, 256, (2, N)).astype(np.int32)


def test_sweep_rows_measure_error_work_and_time(mini, mini_params, prompts):
    rows = rw.sweep(mini, mini_params, prompts, windows=[4, N], splits=[None], steps=3, reps=1)
    assert [(r["window"], r["split"]) for r in rows] == [(4, mini.first_decoder_layer), (N, mini.first_decoder_layer)]
    small, whole = rows
    assert whole["kl_end"] == 0 and whole["top1_end"] == 1 and whole["kl_steps"] == [0, 0, 0]  # R ≥ N is exact
    assert small["kl_end"] > 0 and len(small["top1_steps"]) == 3
    assert small["work_ratio"] == token_layers(mini, ReplayPolicy(window=4), N) / token_layers(mini, EXACT, N)
    assert whole["work_ratio"] == 1 and all(r["wall_ratio"] > 0 for r in rows)
    for r in rows:  # every error measure with its interval over the 2 prompts
        assert {k: v["n"] for k, v in r["intervals"].items()} == dict.fromkeys(
            ("kl_end", "top1_end", "kl_steps", "top1_steps"), 2)
        assert r["intervals"]["kl_end"]["value"] == pytest.approx(r["kl_end"], abs=1e-8)
    assert whole["intervals"]["kl_end"]["hi"] == 0 and whole["intervals"]["top1_end"]["lo"] < 1  # 2 of 2: Wilson
    header, *lines, note = rw.format_table(rows).splitlines()
    assert header.split()[:2] == ["split", "window"] and len(lines) == 2 and note.endswith("n = 2")
    iv = small["intervals"]["top1_steps"]
    assert stats.interval_text(iv) in lines[0]
    assert f"{small['work_ratio']:.4g}" in lines[0]
    untimed = rw.sweep(mini, mini_params, prompts, windows=[4], splits=[None], steps=0, reps=0)
    assert "wall_ratio" not in untimed[0] and untimed[0]["kl_end"] == small["kl_end"]


def test_prompt_intervals_average_each_prompts_steps_then_resample_prompts():
    """Over the generated tokens (`[steps, B]`) each prompt's mean is one sample: prompt 0 never errs and prompt 1
    always does, so the interval spans [0, 1]; averaging each step over the prompts instead would claim [0.5, 0.5].
    One prompt has no interval."""
    steps = np.array([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    out = rw.prompt_intervals(np.array([0.0, 1.0]), np.array([1.0, 0.0]), steps, 1 - steps)
    assert out["kl_steps"]["n"] == 2 and out["kl_steps"]["value"] == pytest.approx(0.5)
    assert (out["kl_steps"]["lo"], out["kl_steps"]["hi"]) == (0.0, 1.0)
    assert out["top1_end"]["value"] == 0.5 and 0 < out["top1_end"]["lo"] < 0.5 < out["top1_end"]["hi"] < 1
    assert rw.prompt_intervals(np.zeros(1), np.ones(1), np.zeros((3, 1)), np.ones((3, 1))) is None
    assert set(rw.prompt_intervals(np.zeros(2), np.ones(2), [], [])) == {"kl_end", "top1_end"}  # no steps taken


def test_prefix_hit_scenarios_reproduce_the_spec_equalities(mini, mini_params, prompts):
    """With R ≥ N: cold, a snapshot hit under "borrow" and encoder replay are the exact prefill; "truncate" is
    not (its decoder windows stop at the hit)."""
    rows = rw.prefix_hits(mini, mini_params, prompts, hits=[16], policy=ReplayPolicy(window=N), chunk=8, steps=2)
    by = {r["scenario"]: r for r in rows}
    assert list(by) == ["cold", "snapshot, truncate", "snapshot, borrow", "encoder replay"]
    for name in ("cold", "snapshot, borrow", "encoder replay"):  # the reference is one call, these are chunked
        assert max(by[name]["kl_end"], *by[name]["kl_steps"]) < 1e-6 and by[name]["top1_end"] == 1, name
    assert by["snapshot, truncate"]["kl_end"] > 1e-4
    assert by["snapshot, borrow"]["work"] == by["snapshot, truncate"]["work"] < by["encoder replay"]["work"]
    assert by["encoder replay"]["work"] == by["cold"]["work"] == token_layers(mini, ReplayPolicy(window=N), N) * 2


def test_sweep_windows_hold_every_point_where_a_tail_layer_stops_being_cut(tiny, mini):
    """tiny: W = 16 and 20 tail layers, so the points are 4, 8, then 16, 31, … 301 = exact_window (one per layer),
    then 20·W; a later split leaves fewer tail layers and fewer points."""
    got = rw.sweep_windows(tiny)
    assert got[:3] == [4, 8, 16] and got[-2:] == [301, 320]
    assert got[2:-1] == [k * 15 + 1 for k in range(1, 21)] and got[-2] == exact_window(tiny)
    later = rw.sweep_windows(tiny, split_layer=tiny.num_hidden_layers - 2)
    assert later == [4, 8, 16, exact_window(tiny, tiny.num_hidden_layers - 2), 320] == [4, 8, 16, 31, 320]
    assert rw.sweep_windows(mini, most=2) == [4, 8, 16, 31, 32, 46, 61]
    with pytest.raises(ValueError, match="split_layer"):
        rw.sweep_windows(mini, split_layer=0)


def test_layer_savings_split_the_whole_saving_over_the_tail_layers(mini, mini_params, prompts):
    got = rw.layer_savings(mini, mini_params, prompts, window=4, reps=3)
    assert [r["layer"] for r in got["layers"]] == list(range(mini.first_decoder_layer, mini.num_hidden_layers))
    assert all(r["saved_s"]["n"] == 3 for r in got["layers"]) and got["saved_s"]["n"] == 3
    # Telescoping: the per-layer means add up to the mean whole saving (exact − split at the first tail layer).
    assert sum(r["saved_s"]["value"] for r in got["layers"]) == pytest.approx(got["saved_s"]["value"], abs=1e-5)
    assert got["exact_s"] > 0 and got["replay_s"] > 0
    last = mini.num_hidden_layers - 1
    top = rw.layer_savings(mini, mini_params, prompts, window=4, reps=2, first=last)  # the top layer alone
    assert [r["layer"] for r in top["layers"]] == [last] and top["saved_s"]["n"] == 2
    with pytest.raises(ValueError, match="split_layer=0"):
        rw.layer_savings(mini, mini_params, prompts, window=4, first=0)


def test_the_committed_results_hold_the_bound():
    """notebooks/replay_windows.json, the notebook's full run on the shipped 40-layer model: from R = exact_window
    on, the bounded prefill gives the exact next-token distribution (float rounding) on every prompt, at the prompt
    end and over the next tokens; the figures stand on at least 64 prompts each, and the per-layer saving covers
    the 20 decoder layers."""
    got = results.load("replay_windows", fast=False)
    assert not got["fast"] and got["model"]["layers"] == 40 and got["model"]["name"] == "tiny-v41"
    bound = got["model"]["exact_window"]
    for part in ("text", "passkey"):
        rows = got[part]["rows"]
        assert got[part]["prompts"] >= 64 and all(iv["n"] == got[part]["prompts"]
                                                  for r in rows for iv in r["intervals"].values())
        exact = [r for r in rows if r["window"] >= bound]
        assert len(exact) == 2, part  # the bound and 20·W
        for r in exact:
            assert max(abs(r["kl_end"]), *map(abs, r["kl_steps"])) < 1e-6, (part, r["window"])
            assert r["top1_end"] == 1 and set(r["top1_steps"]) == {1}, (part, r["window"])
    assert [r["layer"] for r in got["layer_savings"]["layers"]] == list(range(20, 40))
    assert got["release_8k"]["work_saving"] == pytest.approx(0.4676, abs=5e-5)


def test_the_notebooks_prose_quotes_its_results():
    """The headline figures of the notebook's reading are the saved results, so a re-run that moves them fails
    here until the prose is rewritten."""
    got = results.load("replay_windows", fast=False)
    prose = nbformat.read(NOTEBOOK, as_version=4).cells[-1].source
    r4 = next(r for r in got["text"]["rows"] if r["window"] == 4)["intervals"]
    long = got["long"]
    for quoted in (stats.interval_text(r4["kl_end"], ".3f"), stats.interval_text(r4["top1_end"]),
                   stats.interval_text(got["layer_savings"]["saved_s"]),
                   f"{100 * (1 - long['work_ratio']):.2f} % of the work",
                   f"{100 * (1 - long['wall_ratio']):.1f} % of the wall time"):
        assert quoted in " ".join(prose.split()), quoted
