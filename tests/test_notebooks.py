"""Every notebook runs end to end at CI sizes (`CSA2_FAST=1`: small sizes, the fast research checkpoint), so
none can rot; `make notebooks` runs them at full size and saves their outputs, which are committed."""

import nbformat
import pytest

from experiments import notebooks

NOTEBOOKS = notebooks.paths()
IDS = [p.stem for p in NOTEBOOKS]


def test_there_are_notebooks():
    assert {p.stem for p in NOTEBOOKS} >= {"replay_windows", "fp4_qat", "topk_candidates", "kv_selection", "dspark",
                                           "ruler"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_notebook_holds_the_outputs_of_a_full_run(path):
    """Plots and tables are readable without running anything: every code cell ran, in order, at full size."""
    cells = _code_cells(nbformat.read(path, as_version=4))
    assert _ran_in_order(cells)
    assert all(c.outputs for c in cells), "a code cell without output: run `make notebooks`"
    assert not [o for c in cells for o in c.outputs if o.output_type == "error"]
    assert "fast mode: False" in _first_output(cells)
    assert any("image/png" in o.get("data", {}) for c in cells for o in c.outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_in_fast_mode(path):
    """`execute` raises on the first failing cell; what it hands back must show that every code cell ran, once
    and in order, in a kernel that saw the fast setting."""
    cells = _code_cells(notebooks.execute(path, fast=True, timeout=900))
    assert _ran_in_order(cells)
    assert "fast mode: True" in _first_output(cells)


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def _ran_in_order(cells) -> bool:
    return [c.execution_count for c in cells] == list(range(1, len(cells) + 1))


def _first_output(cells) -> str:
    """The text the first code cell printed (every notebook reports its mode there)."""
    return "".join(o.get("text", "") for o in cells[0].outputs)
