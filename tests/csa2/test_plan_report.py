"""Tests for `python -m csa2 inspect` (csa2/plan_report.py): plan rows and the SPEC §8 memory figures."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from csa2.cli import main
from csa2.plan_report import inspect_report

ROOT = Path(__file__).resolve().parents[2]  # the repository root
ROW = re.compile(r"^\s*(\d+)\s+(swa|full|reindex|reuse)\s+(\d+)\s+(\S+)\s+(\S+)\s+(encoder|decoder)\b\s*(.*)$")

# SPEC §2, released schedule: (role, ratio, kv_src, idx_src, part, notes) per layer.
V41_ROLES = ["swa"] * 2 + (["full"] + ["reuse"] * 5) * 3 + ["full"] + ["reuse"] * 3 + (["reindex"] + ["reuse"] * 3) * 4
V41_RATIOS = [0] * 2 + [2] * 18 + [1] * 20
V41_KV = ["-"] * 2 + [str(max(s for s in (2, 8, 14, 20) if s <= i)) for i in range(2, 40)]
V41_IDX = ["-"] * 2 + [str(max(s for s in (2, 8, 14, 20, 24, 28, 32, 36) if s <= i)) for i in range(2, 40)]
V41_NOTES = {1: "engram", 14: "engram", 20: "candidate-source", 24: "scores-candidates", 28: "scores-candidates",
             32: "scores-candidates", 36: "scores-candidates"}


def run_cli(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "csa2", "inspect", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def plan_rows(text):
    return [m.groups() for m in map(ROW.match, text.splitlines()) if m]


def check_v41_plan(text):
    rows = plan_rows(text)
    assert len(rows) == 40
    for i, (idx, role, ratio, kv, isrc, part, notes) in enumerate(rows):
        assert int(idx) == i
        assert role == V41_ROLES[i], i
        assert int(ratio) == V41_RATIOS[i], i
        assert (kv, isrc) == (V41_KV[i], V41_IDX[i]), i
        assert part == ("encoder" if i < 20 else "decoder"), i
        assert notes.strip() == V41_NOTES.get(i, ""), i


def test_expected_tables_are_consistent():
    assert len(V41_ROLES) == len(V41_RATIOS) == len(V41_KV) == len(V41_IDX) == 40
    assert [i for i, r in enumerate(V41_ROLES) if r == "full"] == [2, 8, 14, 20]
    assert [i for i, r in enumerate(V41_ROLES) if r == "reindex"] == [24, 28, 32, 36]


def test_cli_v41_flash_at_1m():
    res = run_cli("--preset", "v41_flash", "--context", "1048576")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert re.search(r"Global KV per token\s+890\.0 B\s*$", out, re.M), out
    assert re.search(r"Global KV at context\s+933\.23 MB\s*$", out, re.M), out  # 890 × 2^20 B
    assert re.search(r"SWA rings, W slots.*\s2\.70 MB\s*$", out, re.M), out  # 40 × 128 × 528 B
    assert re.search(r"SWA rings, W \+ max_draft slots\s+2\.81 MB\s*$", out, re.M), out  # 40 × 133 × 528 B
    assert "swa ×2, full ×4, reindex ×4, reuse ×30" in out
    check_v41_plan(out)


def test_cli_tiny():
    res = run_cli("--preset", "tiny", "--context", "4096")
    assert res.returncode == 0, res.stderr
    assert re.search(r"Global KV per token\s+87\.5 B\s*$", res.stdout, re.M), res.stdout
    check_v41_plan(res.stdout)  # tiny keeps the released schedule


def test_cli_bad_context_is_a_one_line_error():
    res = run_cli("--preset", "tiny", "--context", "7")
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and "capacity=7" in lines[0]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("args,match", [
    (["--preset", "tiny", "--context", "131072"], "max_position_embeddings"),
    (["--preset", "mini", "--context", "64", "--batch", "0"], "batch=0"),
])
def test_main_bad_input_returns_2(args, match, capsys):
    assert main(["inspect", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and match in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_report_float_format_and_batch():
    text = inspect_report("tiny", 4096, batch=2, cache_format="float")
    assert re.search(r"Global KV per token\s+640\.0 B\s*$", text, re.M)
    # 2 rows × 4096 tokens × 640 B = 5,242,880 B
    assert re.search(r"Global KV at context\s+5\.24 MB\s*$", text, re.M)


def test_report_mini_plan():
    rows = plan_rows(inspect_report("mini", 64))
    assert [r[1] for r in rows] == ["swa", "full", "reuse", "reuse", "full", "reuse", "reindex", "reuse"]
    assert [r[6].strip() for r in rows] == ["", "engram", "", "", "candidate-source", "", "scores-candidates", ""]
