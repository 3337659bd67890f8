"""RULER-style grids (`experiments.ruler`): answer scoring on hand cases, and cells read on the fast research
checkpoint under the model's own top-k and under a policy."""

import jax
import jax.numpy as jnp
import nbformat
import numpy as np
import pytest

from csa2 import model
from experiments import results, ruler
from experiments.kv_selection import answer_scores
from infer import stats
from research import selection
from train import longctx

V = 12


def _onehot_logprobs(tokens: np.ndarray) -> np.ndarray:
    """Log-probabilities `[B, n, V]` with 0.9 on `tokens` and the rest spread evenly."""
    p = np.full((*tokens.shape, V), 0.1 / (V - 1))
    np.put_along_axis(p, tokens[..., None], 0.9, axis=-1)
    return np.log(p)


def test_answer_scores_count_only_the_masked_tokens_as_retrieved():
    answers = np.array([[1, 2, 10, 3, 4], [1, 2, 10, 3, 4]])  # "12, 34": token 10 is the separator
    mask = np.array([True, True, False, True, True])
    predicted = answers.copy()
    predicted[0, 2] = 11  # row 0: a wrong separator; row 1: one wrong digit
    predicted[1, 3] = 5
    got = answer_scores(_onehot_logprobs(predicted), answers, 0, mask)
    np.testing.assert_array_equal(got["exact"], [0.0, 0.0])
    np.testing.assert_array_equal(got["digits"], [1.0, 0.75])
    wrong, right = -np.log2(0.1 / (V - 1)), -np.log2(0.9)
    np.testing.assert_allclose(got["bits"], [right, (3 * right + wrong) / 4])
    assert answer_scores(_onehot_logprobs(answers), answers, 0, mask)["exact"].tolist() == [1.0, 1.0]
    assert answer_scores(_onehot_logprobs(predicted), answers, 0)["digits"].tolist() == [0.8, 0.8]  # all tokens


def test_the_tasks_are_rulers():
    assert {k: (t.keys, t.values, t.queries) for k, t in ruler.TASKS.items()} == {
        "single": (1, 1, 1), "multikey": (4, 1, 1), "multivalue": (1, 3, 1), "multiquery": (4, 1, 2)}
    tokens, answers, mask = ruler.examples(ruler.TASKS["multiquery"], 300, 0.5, 3)
    assert tokens.shape == (3, 300 + answers.shape[1] - 1) and answers.shape == (3, 10) and mask.sum() == 8
    np.testing.assert_array_equal(tokens[:, 300:], answers[:, :-1])  # teacher forcing
    again, _, _ = ruler.examples(ruler.TASKS["multiquery"], 300, 0.5, 5)
    np.testing.assert_array_equal(again[:3], tokens)  # the first prompts are the same for any sample count


@pytest.fixture(scope="module")
def fast_model():
    cfg, params, _ = longctx.checkpoint(fast=True, log=lambda _: None)
    return cfg, params


def test_a_grid_cell_is_its_prompts_read_teacher_forced(fast_model):
    """Reading 3 prompts 2 at a time (the last batch padded) scores as one plain forward of the 3 does."""
    cfg, params = fast_model
    task = ruler.TASKS["multivalue"]
    cells = ruler.grid(cfg, params, task, [200], [0.2, 0.8], 3, batch=2)
    assert list(cells) == ["200"] and list(cells["200"]) == ["0.2", "0.8"]
    for depth in (0.2, 0.8):
        tokens, answers, mask = ruler.examples(task, 200, depth, 3)
        logits, _ = model.forward(cfg, params, jnp.asarray(tokens), qat=True)
        lp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
        want = answer_scores(lp, answers, 200 - 1, mask)
        cell = cells["200"][f"{depth:g}"]
        assert (cell["exact"]["n"], cell["digits"]["n"], cell["bits"]["n"]) == (3, 3, 3)  # intervals over the prompts
        np.testing.assert_allclose(cell["digits_by_prompt"], want["digits"], atol=1e-4)
        assert cell["right"] == want["exact"].sum()
        assert cell["exact"]["value"] == pytest.approx(want["exact"].mean(), abs=1e-3)
        assert cell["digits"]["value"] == pytest.approx(want["digits"].mean(), abs=1e-3)
        assert cell["bits"]["value"] == pytest.approx(want["bits"].mean(), abs=2e-3)
    lengths, depths, values = ruler.heatmap(cells, "bits")
    assert (lengths, depths) == (["200"], ["0.2", "0.8"]) and values.shape == (1, 2)
    assert values[0, 1] == cells["200"]["0.8"]["bits"]["value"]


def test_by_length_pools_the_prompts_of_every_depth():
    """3 of 4 prompts right at one depth and 0 of 4 at the other: 3 of 8 at that length, Wilson over the 8; the
    digits the mean of the 8 prompts' shares with a bootstrap over them."""
    def cell(digits):
        right = sum(d == 1 for d in digits)
        return {"right": right, "exact": stats.proportion_interval(right, len(digits)).as_dict(),
                "digits_by_prompt": digits}
    low, high = [1.0, 1.0, 1.0, 0.5], [0.0, 0.25, 0.25, 0.5]
    pooled = ruler.by_length({"256": {"0.1": cell(low), "0.9": cell(high)}, "512": {"0.1": cell([1.0, 1.0])}})
    assert pooled["256"]["exact"] == stats.proportion_interval(3, 8).as_dict()
    assert pooled["256"]["digits"] == stats.mean_interval(low + high).as_dict()
    assert pooled["512"]["exact"] == stats.proportion_interval(2, 2).as_dict()


def test_paired_by_length_differs_prompt_by_prompt_over_every_depth():
    """A policy 0.25 above the other on every prompt differs by exactly 0.25 at that length, whatever the prompts'
    spread; the grids must hold the same cells."""
    def cell(digits):
        return {"digits_by_prompt": digits}
    low, high = [1.0, 0.75, 0.5, 0.0], [0.0, 0.25, 0.25, 0.5]
    ours = {"256": {"0.1": cell(low), "0.9": cell(high)}, "512": {"0.1": cell([0.5, 1.0])}}
    theirs = {"256": {"0.1": cell([d - 0.25 for d in low]), "0.9": cell([d - 0.25 for d in high])},
              "512": {"0.1": cell([0.5, 0.0])}}
    got = ruler.paired_by_length(ours, theirs)
    assert got["256"]["n"] == 8 and got["256"]["value"] == got["256"]["lo"] == got["256"]["hi"] == 0.25
    assert got["512"] == stats.mean_interval([0.0, 1.0]).as_dict()
    with pytest.raises(ValueError, match="length 512 has depths"):
        ruler.paired_by_length(ours, {**theirs, "512": {"0.5": cell([0.5, 0.0])}})
    with pytest.raises(ValueError, match="other prompt counts"):
        ruler.paired_by_length(ours, {**theirs, "512": {"0.1": cell([0.5])}})


def test_a_policy_reads_the_answer_steps(fast_model):
    """At a budget of one entry, the oracle reads other entries than the model's own top-k: the answer moves."""
    cfg, params = fast_model
    at = cfg.replace(index_topk=1, candidate_topk_blocks=1)
    task = ruler.TASKS["single"]
    own = ruler.grid(at, params, task, [200], [0.5], 2, batch=2)
    oracle = ruler.grid(at, params, task, [200], [0.5], 2, batch=2, policy=selection.Oracle())
    assert own["200"]["0.5"]["bits"]["value"] != oracle["200"]["0.5"]["bits"]["value"]


def test_held_out_prompts_are_the_same_tasks_in_other_words():
    task = ruler.TASKS["multikey"]
    train, answers, mask = ruler.examples(task, 300, 0.5, 2)
    held, held_answers, held_mask = ruler.examples(task, 300, 0.5, 2, template="held_out")
    np.testing.assert_array_equal(held_answers, answers)  # the same draws: the same keys asked
    np.testing.assert_array_equal(held_mask, mask)
    assert held.shape == train.shape and not np.array_equal(held, train)


def test_the_committed_results_are_their_prompts():
    """notebooks/ruler.json, the notebook's full run: at least 64 held-out-wording prompts per cell up to the
    longest training length, under csa2 and at least one KV-selection policy; each cell's figures are what its
    per-prompt records give, the by-length figures pool those cells, and each policy's paired difference to csa2 is
    that of their per-prompt records."""
    got = results.load("ruler", fast=False)
    sizes = got["sizes"]
    assert not got["fast"] and sizes["samples"] >= 64 and sizes["template"] == "held_out"
    assert max(sizes["lengths"]) == 2048
    assert "csa2" in got["grids"] and set(got["minus_csa2"]) == set(got["grids"]) - {"csa2"} != set()
    for name, by_task in got["minus_csa2"].items():
        assert by_task == {task: ruler.paired_by_length(got["grids"][name][task], got["grids"]["csa2"][task])
                           for task in ruler.TASKS}
    for name, by_task in got["grids"].items():
        assert set(by_task) == set(ruler.TASKS)
        for task, cells in by_task.items():
            for row in cells.values():
                for cell in row.values():
                    n = len(cell["digits_by_prompt"])
                    assert n == cell["exact"]["n"] == cell["digits"]["n"] == sizes["samples"]
                    assert cell["exact"]["value"] == pytest.approx(cell["right"] / n, abs=1e-3)
                    assert cell["digits"]["value"] == pytest.approx(np.mean(cell["digits_by_prompt"]), abs=1e-3)
            assert got["by_length"][name][task] == ruler.by_length(cells)


def test_the_notebooks_prose_quotes_its_results():
    """The headline figures of the notebook's reading are the saved results, so a re-run that moves them fails
    here until the prose is rewritten."""
    got = results.load("ruler", fast=False)
    prose = " ".join(nbformat.read(results.ROOT / "notebooks" / "ruler.ipynb", as_version=4).cells[-1].source.split())
    by_length, cells = got["by_length"]["csa2"], got["grids"]["csa2"]
    quoted = [by_length[task][n]["digits"] for task in ruler.TASKS for n in ("256", "2048")]
    quoted += [cells[task]["2048"][depth]["digits"] for task in ("single", "multikey") for depth in ("0.1", "0.9")]
    quoted.append(by_length["single"]["2048"]["exact"])
    for iv in quoted:
        assert stats.interval_text(iv) in prose, iv
    snapkv = got["minus_csa2"]["snapkv"]
    paired = [snapkv["single"]["2048"], snapkv["multikey"]["2048"], snapkv["multiquery"]["256"],
              snapkv["multiquery"]["2048"], snapkv["multivalue"]["2048"]]
    for iv in paired:
        assert stats.interval_text(iv, "+.3f") in prose, iv
    # what the prose says of the paired intervals: single and multikey hold 0 everywhere, multiquery nowhere,
    # multivalue excludes 0 at 512 and 2048 only
    excludes = {task: [n for n, iv in by_n.items() if iv["lo"] > 0 or iv["hi"] < 0] for task, by_n in snapkv.items()}
    assert excludes == {"single": [], "multikey": [], "multivalue": ["512", "2048"],
                        "multiquery": ["256", "512", "1024", "2048"]}
    assert all(iv["hi"] < 0 for iv in snapkv["multiquery"].values())
    assert max(abs(iv["value"]) for by_n in snapkv.values() for iv in by_n.values()) <= 0.04
    assert f"{got['seconds']['csa2']:.0f} s for csa2's grids, {got['seconds']['snapkv']:.0f} s for" in prose
