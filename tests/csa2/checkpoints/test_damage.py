"""Damaged and half-written checkpoints are refused by name, never restored: a truncated, missing or altered array
file, unreadable metadata, a missing item, a save killed with SIGKILL, and the same through `python -m infer`."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import optax
import pytest

from csa2.checkpoints import native as checkpoint
from csa2.model import abstract_params
from csa2.presets import preset
from tests.csa2.checkpoints.test_checkpoint import assert_bit_identical, random_like

CFG = preset("mini")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Random mini params saved at steps 1 and 2 (the arrays, not a model: nothing compiles)."""
    params = random_like(abstract_params(CFG), 0)
    directory = tmp_path_factory.mktemp("damage") / "run"
    for step in (1, 2):
        checkpoint.save(directory, step, params=params, opt_state=optax.EmptyState(), cfg=CFG)
    return directory, params


def _largest_array_file(run):
    files = [os.path.join(root, f) for root, _, names in os.walk(run / "2" / "params") for f in names
             if os.sep + "d" + os.sep in os.path.join(root, f)]
    return max(files, key=os.path.getsize)


def _flip_a_byte(run):
    path = _largest_array_file(run)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))


DAMAGE = {
    "truncated array file": (lambda run: os.truncate(_largest_array_file(run), 1000), "OUT_OF_RANGE"),
    "missing array file": (lambda run: os.remove(_largest_array_file(run)), "an array file of \\['params'\\]"),
    "altered array bytes": (_flip_a_byte, "differ from the SHA-256 saved with them"),
    "unreadable metadata": (lambda run: (run / "2" / "meta" / "metadata").write_text("{not json"),
                            "the metadata item \\(meta\\)"),
    "missing params item": (lambda run: shutil.rmtree(run / "2" / "params"), "the metadata of \\['params'\\]"),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_a_damaged_step_is_refused_by_name_and_the_others_still_restore(saved, tmp_path, name):
    """Each damage gives one ValueError naming the checkpoint, step 2 and what is damaged, with the steps that
    remain; step 1 restores bit for bit, untouched."""
    directory, params = saved
    run = tmp_path / "run"
    shutil.copytree(directory, run)
    damage, what = DAMAGE[name]
    damage(run)
    with pytest.raises(ValueError, match=f"checkpoint {run} step 2: .*{what}.*restore another step \\(available: "
                                         "\\[1\\]\\)"):
        checkpoint.restore_params(run, CFG)
    assert_bit_identical(checkpoint.restore_params(run, CFG, step=1)[1], params)


def test_python_m_infer_reports_a_damaged_checkpoint_in_one_line(saved, tmp_path, capsys):
    from infer.__main__ import main

    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    _flip_a_byte(run)
    assert main(["--checkpoint", str(run), "--prompt", "x", "--compile-cache", "off"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint {run} step 2: params is damaged")


_SAVER = textwrap.dedent("""
    import sys, jax, optax
    from csa2.checkpoints import native
    from csa2.model import abstract_params
    from csa2.presets import preset
    from tests.csa2.checkpoints.test_checkpoint import random_like
    cfg = preset("mini")
    params = random_like(abstract_params(cfg), 0)
    for step in range(1, 10**6):
        native.save(sys.argv[1], step, params=params, opt_state=optax.EmptyState(), cfg=cfg, keep=2)
        print(step, flush=True)
""")


def test_a_save_killed_with_sigkill_leaves_the_finished_steps_readable(saved, tmp_path):
    """A process saving step after step is killed (SIGKILL) at three points inside a save: the latest complete
    step restores bit for bit (with a warning when an unfinished save was left behind), and nothing earlier is
    lost."""
    params, interrupted = saved[1], []
    for trial, delay in enumerate((0.0, 0.05, 0.15)):
        run = tmp_path / f"run{trial}"
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(run)], stdout=subprocess.PIPE, text=True,
                                cwd=ROOT,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert proc.stdout.readline().strip() == "1"  # step 1 is complete; step 2 is being written
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        unfinished = any(".orbax-checkpoint-tmp" in name for name in os.listdir(run))
        interrupted.append(unfinished)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            latest = checkpoint.latest_step(run)
            cfg, restored = checkpoint.restore_params(run)
        said = [str(w.message) for w in caught if "ignoring the unfinished save" in str(w.message)]
        assert len(said) == unfinished and latest >= 1 and cfg == CFG
        assert_bit_identical(restored, params)
    assert any(interrupted), "no kill landed inside a save: the test did not exercise a half-written step"


def test_damage_checks_cost_nothing_for_checkpoints_without_digests(saved, tmp_path):
    """A checkpoint written before digests existed (meta without `digests`) restores as before."""
    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    meta = run / "2" / "meta" / "metadata"
    record = json.loads(meta.read_text())
    del record["digests"]
    meta.write_text(json.dumps(record))
    assert_bit_identical(checkpoint.restore_params(run, CFG)[1], saved[1])
