"""The fuzz harness's fast slice (`python -m infer.fuzz` runs thousands of cases): 20 cases of every property under
the float numerics, chunk invariance and commit under the SPEC §8 numerics, the sharded property on 8 simulated
devices in a subprocess, and planted mutants that the properties must catch (last: a mutant of traced code drops
the compiled programs). Chunk invariance is marked `cross_shape` (run again under another instruction set by
`tests/test_isa.py`)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from csa2.presets import preset
from infer.fuzz import mutants, run
from infer.fuzz.bench import Bench
from infer.fuzz.properties import PROPERTIES, Property

ROOT = Path(__file__).resolve().parents[2]
CASES, ROWS = 20, 4
CROSS_SHAPE = ("chunk_exact", "chunk_replay", "fork_moved")
IN_PROCESS = [pytest.param(name, marks=[pytest.mark.cross_shape] if name in CROSS_SHAPE else [])
              for name in PROPERTIES if name != "sharded"]


@pytest.fixture(scope="module")
def bench(mini_params):
    return Bench(preset("mini"), mini_params, numerics="float", rows=ROWS)


@pytest.mark.parametrize("name", IN_PROCESS)
def test_property_holds_on_random_cases(bench, name):
    report = run.run(bench, PROPERTIES[name], CASES, seed=1)
    print(f"\n{report.line()}")
    assert report.cases >= CASES and report.violations == 0, report.first_failure


@pytest.mark.cross_shape
@pytest.mark.parametrize("name", ["chunk_exact", "commit"])
def test_property_holds_under_the_spec_numerics(mini_params, name):
    """Under the SPEC §8 numerics a chunking or a commit agrees with its reference within `SPEC_TOLERANCE`, except
    where a rare stored element flips at a rounding midpoint: such a case holds under the float numerics."""
    bench = Bench(preset("mini"), mini_params, numerics="spec", rows=ROWS)
    reference = Bench(preset("mini"), mini_params, numerics="float", rows=ROWS)
    report = run.run(bench, PROPERTIES[name], 8, seed=1, reference=reference)
    print(f"\n{report.line()}")
    assert report.holds, report.first_failure


def test_a_violation_is_explained_only_where_the_float_numerics_hold(mini_params):
    """A case beyond the SPEC tolerance is drawn again under the float numerics: explained if it holds there."""
    spec = Bench(preset("mini"), mini_params, numerics="spec", rows=ROWS)
    reference = Bench(preset("mini"), mini_params, numerics="float", rows=ROWS)

    def check(bench, rng):  # rows: flipped then fine in float, fine, not a case, wrong in both
        return np.array([0.5, 0.0, np.nan, 0.5] if bench.numerics == "spec" else [1e-7, 0.0, np.nan, 1.0])

    report = run.run(spec, Property("synthetic", check, bitwise=False), 3, reference=reference)
    assert (report.cases, report.violations, report.explained, report.holds) == (3, 2, 1, False)
    assert report.first_failure["rows"] == [3]


def test_mutants_are_restored(bench):
    """Planting puts back every patched function, even when the run inside fails."""
    before = {name: [getattr(owner, attr) for owner, attr, _ in mutants.MUTANTS[name]()] for name in mutants.MUTANTS}
    with pytest.raises(RuntimeError), mutants.planted("commit"):
        raise RuntimeError("inside")
    after = {name: [getattr(owner, attr) for owner, attr, _ in mutants.MUTANTS[name]()] for name in mutants.MUTANTS}
    assert before == after


def test_a_batch_is_drawn_again_alone(bench):
    """`--first-batch K` reruns batch K of a run: the same draws, the same differences."""
    prop = PROPERTIES["chunk_exact"]
    errors = [prop.check(bench, run.rng_for(5, prop.name, 3)) for _ in range(2)]
    np.testing.assert_array_equal(errors[0], errors[1])


def test_command_runs_the_sharded_property_on_simulated_devices(tmp_path):
    """`python -m infer.fuzz --property sharded` (8 simulated CPU devices): mesh 2 × 2 × 2 ≡ one device."""
    out = subprocess.run([sys.executable, "-m", "infer.fuzz", "--property", "sharded", "--cases", "8",
                          "--json", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "sharded" in out.stdout and "0 violations" in out.stdout


def test_command_refuses_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "infer.fuzz", "--rows", "3"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "--rows 3" in out.stderr


@pytest.mark.parametrize("name", ["commit", "fork", "prefix_hit", "chunk_exact", "verify_scratch", "generate_stops"])
def test_planted_mutant_is_caught(bench, name):
    """Each property catches its mutant within 8 batches (the sharded one, and chunk_replay's and fork_moved's,
    which are chunk_exact's and fork's, run in `python -m infer.fuzz --mutants`)."""
    with mutants.planted(name):
        report = run.run(bench, PROPERTIES[name], 8 * ROWS, seed=1, until_failure=True)
    assert not report.holds and report.first_failure is not None


def test_command_offers_every_property():
    """The CLI's property names (kept before JAX is imported) are the harness's."""
    from infer.fuzz.__main__ import NAMES
    assert NAMES == tuple(PROPERTIES)
