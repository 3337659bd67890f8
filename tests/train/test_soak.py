"""train.soak: a `python -m train` run killed with SIGKILL and resumed ends bit for bit as an uninterrupted one."""

import json

from train import soak


def test_a_killed_and_resumed_run_equals_an_uninterrupted_one(tmp_path, capsys):
    """mini, 30 steps of 1 × 16 tokens, a checkpoint every 5: killed at a random moment after step 10, resumed;
    parameters, optimizer state, RNG, data position and every logged loss equal the reference run's."""
    code = soak.main(["--steps", "30", "--save-every", "5", "--batch-size", "1", "--seq-len", "16", "--kill-seed", "1",
                      "--out", str(tmp_path / "soak")])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert code == 0 and summary["identical"], summary
    assert summary["final_step"] == [30, 30] and summary["resumed_from_step"] >= 10
    assert summary["killed_before_finishing"]  # kill seed 1 draws 13 % of the remaining time
