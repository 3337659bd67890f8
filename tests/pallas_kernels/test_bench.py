"""`python -m pallas_kernels.bench` runs end to end here (the kernel lines through the interpreter), so the
device run finds it working."""

import json

from pallas_kernels import bench


def test_bench_prints_every_line_kind(capsys):
    bench.main(["--contexts", "512", "--reps", "1", "--kernels"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    kinds = [line["bench"] for line in lines]
    assert kinds == ["decode_group", "topk", "decode_group_pallas", "kernel", "kernel"], kinds
    assert {line["kernel"] for line in lines if line["bench"] == "kernel"} == {"sparse_attention", "indexer_scores"}
    assert all(line["context"] == 512 for line in lines)
    assert lines[1]["recall"] == 1.0  # approx_max_k is exact off TPU
