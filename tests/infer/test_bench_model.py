"""`python -m infer.bench_model` runs end to end on the smallest sizes it accepts and prints one JSON line per
measurement of every section (decode, donation, host loop, batch, prefill), each with the machine and the config."""

import json

from infer import bench_model

SMALLEST = ["--config", "mini", "--quick", "--contexts", "64", "--decode-contexts", "32", "--decode-steps", "1",
            "--decode-warmup", "1", "--reps", "1", "--donation-context", "32", "--donation-batch", "1",
            "--batches", "1", "--batch-rounds", "1"]


def test_every_section_reports_on_the_smallest_sizes(capsys):
    assert bench_model.main(SMALLEST) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["bench"] for line in lines] == ["setup", "compile", "compile", "decode", "donation", "host_loop",
                                                 "batch", "compile", "compile", "prefill_replay", "run"]
    assert all(line["config"]["name"] == "mini" and "machine" in line for line in lines)
    by_kind = {line["bench"]: line for line in lines}
    assert by_kind["setup"]["contexts"] == [64] and by_kind["setup"]["decode_contexts"] == [32]
    assert by_kind["decode"]["context"] == 32 and by_kind["decode"]["steps"] == 1
    assert by_kind["batch"]["batch"] == 1 and by_kind["batch"]["tokens_per_s"] > 0
    prefill = by_kind["prefill_replay"]
    assert prefill["status"] == "ok" and prefill["context"] == 64
    assert prefill["work_bounded"] <= prefill["work_exact"]
    assert [line["fn"] for line in lines if line["bench"] == "compile"] == ["prefill", "decode_step", "prefill",
                                                                             "prefill"]
