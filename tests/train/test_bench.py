"""`python -m train.bench` runs end to end on the smallest sizes it accepts: one JSON line for the compile of
`train_step` and one for the timed steps, with the machine and the config; `--kernel-impl` adds the step on
another backend with its ratio."""

import json

from train import bench


def test_compile_and_step_lines_on_the_smallest_sizes(capsys):
    assert bench.main(["--config", "mini", "--batch-size", "1", "--seq-len", "16", "--steps", "1",
                       "--kernel-impl", "dense", "--index-topk", "8"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["bench"] for line in lines] == ["compile", "train_step", "train_step_impl"]
    compile_line, step, other = lines
    assert compile_line["fn"] == "train_step" and compile_line["qat"] is True
    assert compile_line["total_s"] >= compile_line["compile_s"] > 0
    assert step["steps"] == 1 and step["median_step_s"] > 0 and step["tokens_per_s"] > 0
    assert other["kernel_impl"] == "dense" and other["vs_config_impl"] > 0
    assert all(line["config"]["name"] == "mini" and line["config"]["seq_len"] == 16 and "machine" in line
               and line["config"]["index_topk"] == 8 and line["config"]["kernel_impl"] == "xla" for line in lines)


def test_bad_sizes_are_refused(capsys):
    assert bench.main(["--steps", "0"]) == 2
    assert "must be ≥ 1" in capsys.readouterr().err
    assert bench.main(["--config", "mini", "--index-topk", "0"]) == 2
    assert "index_topk" in capsys.readouterr().err
