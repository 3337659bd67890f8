"""`python -m pallas_kernels.device_check --dry-run`: the device script runs end to end on CPU (parity of every
op through the interpreter, then `pallas_kernels.bench --kernels`), so a lent GPU finds it working."""

import json

import numpy as np

from pallas_kernels import device_check


def test_dry_run_checks_every_op_and_runs_the_bench(capsys):
    assert device_check.main(["--dry-run"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    parity = [line for line in lines if line.get("check") == "parity"]
    ops = ("sparse_attention", "indexer_scores", "indexer_scores_gathered", "block_max", "sparse_attention_grad")
    assert sorted((line["op"], line["case"]) for line in parity) == sorted((op, f"S={s}") for op in ops for s in (1, 4))
    assert all(line["ok"] and line["same_masks"] for line in parity), parity
    kinds = [line["bench"] for line in lines if "bench" in line]
    assert kinds == ["decode_group", "topk", "decode_group_pallas", "kernel", "kernel"], kinds
    assert lines[-1] == {"check": "summary", "parity_cases": 10, "failed": []}


def test_a_wrong_value_or_mask_fails_the_comparison():
    want = np.array([1.0, -np.inf, 0.0], np.float32)
    assert device_check.compare(want.copy(), want) == (0.0, True)
    err, same = device_check.compare(np.array([1.1, -np.inf, 0.0], np.float32), want)
    assert err > device_check.TOL and same
    assert not device_check.compare(np.array([1.0, 0.0, 0.0], np.float32), want)[1]


def test_without_an_accelerator_it_asks_for_dry_run(capsys):
    assert device_check.main([]) == 2
    assert "pass --dry-run" in capsys.readouterr().err
