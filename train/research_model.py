"""`python -m train.research_model`: build the research model the package ships (`bundled("tiny-v41")`).

    python -m train.research_model [--runs runs/tiny-v41] [--out csa2/checkpoints/shipped/tiny-v41]

Three steps, each resumable:
1. the backbone (`shipped_backbone`): the `tiny` preset (the release's 40-layer schedule: SWA ×2, Full ×4, Reindex ×4,
   Reuse ×30, Engram at layers 1 and 14, candidate source 20; d = 64, byte vocabulary) trained with the long-context
   recipe (`train.longctx`: induction rows, corpus windows, pass-key and multi-needle rows, the curriculum; SPEC §8
   QAT, the SPEC §13 indexer KL), its curriculum cut to `RECIPE.backbone.stages` so it trains in under two hours on 2
   CPU cores, in `RUNS` (resuming); then written to `OUT` in the released layout (`save_hf(formats="released")`: FP8
   block weights, FP4 experts, FP8 Engram rows) with `backbone.json` beside it. Files there of the same backbone
   recipe are the backbone from then on: a rebuild without `RUNS` starts from them;
2. the DSpark drafter (SPEC §12), adapted on that backbone as the files hold it (decoded, as it is served) at the
   release's `dspark_target_layer_ids` (37, 38, 39) on the backbone's own greedy continuations
   (`train.dspark.adapt`), in `RUNS-dspark` (resuming), and written in (`mtp.*`; the backbone's tensors come back
   bit for bit);
3. every figure measured on the written files as `load_hf` reads them (`measure`), written to `accuracy.json` and
   the model card `README.md` (`card`).

The figures (`measure`), each with its n and a 95 % interval, at float32 compute (the preset's):
- pass keys at `eval_lengths` × `eval_depths`, `eval_samples` keys per cell, teacher-forced (every digit's argmax
  right ≡ greedy decoding retrieves the key), exact prefill and under `ReplayPolicy(window=128)`;
- validation bits per byte, float and SPEC §8 numerics, over the corpus's validation stream in batches of 8 × 128;
- the drafter's mean acceptance length (bonus included) at γ = 5, greedy, over held-out prompts
  (`infer.bench_spec.acceptance`);
- `check`: the cheap slice `tests/csa2/checkpoints/test_bundled.py` reproduces from the shipped files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
import time

import numpy as np

from csa2.checkpoints import hf, layouts, native as ckpt, released, shards
from csa2.config import ModelConfig
from csa2.replay import EXACT, ReplayPolicy
from infer import stats
from infer.bench_spec import acceptance
from infer.stats import interval_text
from train import dspark, longctx
from train.data import load_corpus
from train.dspark import DSparkTrainConfig
from train.loop import eval_bits

NAME = "tiny-v41"
OUT = pathlib.Path("csa2/checkpoints/shipped") / NAME
RUNS = pathlib.Path("runs") / NAME
ACCURACY = "accuracy.json"
CARD = "README.md"
BACKBONE = "backbone.json"
COMPUTE_DTYPE = "float32"  # the tiny presets' compute dtype; config.json names none (a loader's choice)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The backbone's long-context recipe, the drafter's adaptation and the sizes of the measured figures."""

    backbone: longctx.LongCtxRecipe = longctx.LongCtxRecipe(
        preset="tiny", stages=((400, 16, 128), (60, 8, 512), (15, 2, 2048)))
    drafter: DSparkTrainConfig = DSparkTrainConfig(steps=240, anchors=16, data="greedy", distill_rows=128)
    replay_window: int = 128  # the release's R = W = 128 (SPEC §11)
    accept_prompts: int = 64
    accept_prompt_len: int = 64
    accept_new_tokens: int = 64
    accept_batch: int = 16
    check_length: int = 512  # the card check: the first sample of pass keys at this length, every depth
    check_prompts: int = 4  # and the acceptance length over the first prompts (in a batch of `accept_batch`)


RECIPE = Recipe()


def bpb_figures(cfg: ModelConfig, params) -> dict:
    """Validation bits per byte, float and SPEC §8 numerics, pooled over 8 × 128-byte batches (the unit of n)."""
    valid = load_corpus().valid
    out = {}
    for name, qat in (("float", False), ("spec", True)):
        bits, count = eval_bits(cfg, params, valid, qat=qat)
        (interval,) = stats.ratio_interval(bits[:, None], count[:, None])
        out[name] = interval.as_dict(4)
    return out


def check_slice(cfg: ModelConfig, params, recipe: Recipe) -> dict:
    """What the card-check test reproduces: the first sample of pass keys at `check_length` (every digit's hit and
    log-probability) and the acceptance length over `check_prompts` prompts."""
    hit, logp = longctx.passkey_reads(cfg, params, recipe.backbone, recipe.check_length, samples=1)
    acc = acceptance(cfg, params, recipe.check_prompts, recipe.accept_prompt_len, recipe.accept_new_tokens,
                     recipe.accept_batch)
    return {"length": recipe.check_length, "hits": hit[0].astype(int).tolist(),
            "logprob": np.round(logp[0], 5).tolist(), "prompts": recipe.check_prompts,
            "prompt_len": recipe.accept_prompt_len, "new_tokens": recipe.accept_new_tokens,
            "batch": recipe.accept_batch, "acceptance_length": acc["acceptance_length"]["value"]}


def measure(path: pathlib.Path, recipe: Recipe, log=print) -> dict:
    """Every figure of the card, measured on the files at `path` as `layouts.load` reads them."""
    cfg, params = layouts.load(path, layouts.load_config(path).replace(dtype=COMPUTE_DTYPE))
    out = {"compute_dtype": COMPUTE_DTYPE}
    t0 = time.perf_counter()
    out["passkey_exact"] = longctx.passkey_figures(cfg, params, recipe.backbone, EXACT)
    log(f"# pass keys, exact prefill: {time.perf_counter() - t0:.0f} s")
    out["passkey_replay"] = longctx.passkey_figures(cfg, params, recipe.backbone,
                                                    ReplayPolicy(window=recipe.replay_window))
    log(f"# pass keys, replay R = {recipe.replay_window}: {time.perf_counter() - t0:.0f} s")
    out["bpb"] = bpb_figures(cfg, params)
    log(f"# bits per byte: {time.perf_counter() - t0:.0f} s")
    out["acceptance"] = acceptance(cfg, params, recipe.accept_prompts, recipe.accept_prompt_len,
                                   recipe.accept_new_tokens, recipe.accept_batch)
    log(f"# acceptance: {time.perf_counter() - t0:.0f} s")
    out["check"] = check_slice(cfg, params, recipe)
    out["measure_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def tensor_summary(path: pathlib.Path, cfg: ModelConfig) -> dict:
    """What the shipped files hold, checked against `released.tensors(cfg)`: every tensor under its released name
    and stored dtype (a quantized one with its UE8M0 scale) and nothing else; counts by dtype and bytes on disk."""
    store = shards.Shards(path)
    table = released.tensors(cfg)
    want = {t.name: t.dtype for t in table} | {t.scale_name: "F8_E8M0" for t in table if t.fmt is not None}
    got = {name: store.dtype(name) for name in store.names()}
    if got != want:
        wrong = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
        raise ValueError(f"{path}: the shards do not hold released.tensors(cfg) as released: "
                         + ", ".join(f"{n} stored {got.get(n)} vs released {want.get(n)}" for n in wrong[:3]))
    dtypes: dict[str, int] = {}
    for code in got.values():
        dtypes[code] = dtypes.get(code, 0) + 1
    files = sorted(p.name for p in path.glob("*.safetensors"))
    return {"released_tensors": len(table), "stored_names": len(got), "by_dtype": dtypes,
            "bytes": sum((path / f).stat().st_size for f in files), "shards": files}


def step_seconds(runs: pathlib.Path, recipe: longctx.LongCtxRecipe) -> float:
    """The backbone's training time from its `metrics.jsonl`: Σ tokens / tokens per second over the steps (compile
    and the first step of each resumed process excluded, the steps that ran twice across a resume counted once)."""
    rates = {}
    for line in (runs / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rates[row["step"]] = row["tokens_per_s"]
    seconds = 0.0
    for step, rate in rates.items():
        rows, length = recipe.stage(step - 1)
        seconds += rows * length / rate if rate > 0 else 0.0
    return round(seconds, 1)


def shipped_backbone(recipe: Recipe, runs: pathlib.Path, out: pathlib.Path, log=print) -> dict:
    """Make `out` hold the trained backbone of `recipe` in the released layout (with a fresh drafter) and return its
    `backbone.json` (the backbone recipe and its training time). Files there of this recipe are kept as they are;
    otherwise the backbone trains in `runs` (resuming a partial run; a finished one is restored) and is written."""
    marker = out / BACKBONE
    wanted = json.loads(json.dumps(dataclasses.asdict(recipe.backbone)))
    if marker.exists() and json.loads(marker.read_text())["recipe"] == wanted:
        return json.loads(marker.read_text())
    runs.parent.mkdir(parents=True, exist_ok=True)
    with longctx.lock(runs):
        longctx.check_recipe(runs, recipe.backbone)
        cfg, state = longctx.fit(recipe.backbone, runs, log=log)
    cfg, params = dspark.with_stages(cfg, state.params, cfg.num_nextn_predict_layers, recipe.drafter.seed)
    if out.exists():
        shutil.rmtree(out)
    hf.save_hf(params, cfg, out, formats="released")
    info = {"recipe": wanted, "train_seconds": step_seconds(runs, recipe.backbone)}
    marker.write_text(json.dumps(info, indent=1) + "\n")
    return info


def build(recipe: Recipe = RECIPE, runs: pathlib.Path = RUNS, out: pathlib.Path = OUT, log=print) -> dict:
    """The shipped files in `out`: the backbone (`shipped_backbone`), then the drafter adapted on that backbone as the
    files hold it (FP8/FP4 weights decoded, as served) in `RUNS-dspark` (resuming), written in; every figure measured
    on the written files; `accuracy.json` and the model card. Returns the report."""
    runs, out = pathlib.Path(runs), pathlib.Path(out)
    backbone = shipped_backbone(recipe, runs, out, log)
    cfg, params = layouts.load(out, layouts.load_config(out).replace(dtype=COMPUTE_DTYPE))
    t0 = time.perf_counter()
    drafter_dir = runs.with_name(runs.name + "-dspark")
    params = dspark.adapt(cfg, params, load_corpus().train, recipe.drafter, drafter_dir, log=lambda _: None,
                          resume=ckpt.latest_step(drafter_dir) is not None, save_every=100)
    drafter_seconds = round(time.perf_counter() - t0, 1)
    hf.save_hf(params, cfg, out, formats="released")  # the same shard names: replaced
    report = {"name": NAME, "command": "python -m train.research_model", "recipe": dataclasses.asdict(recipe),
              "backbone_train_seconds": backbone["train_seconds"], "drafter_seconds": drafter_seconds,
              "tensors": tensor_summary(out, cfg)}
    report.update(measure(out, recipe, log))
    (out / ACCURACY).write_text(json.dumps(report, indent=1) + "\n")
    (out / CARD).write_text(card(report))
    return report


def passkey_table(report: dict) -> str:
    """The card's pass-key table: keys retrieved and digits right per length, exact and under replay."""
    window = report["recipe"]["replay_window"]
    lines = [f"| tokens | keys, exact | digits, exact | keys, replay R = {window} | digits, replay R = {window} |",
             "|---|---|---|---|---|"]
    for length, e in report["passkey_exact"].items():
        r = report["passkey_replay"][length]
        cells = [interval_text(x) for x in (e["keys"], e["digits"], r["keys"], r["digits"])]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _tokens(stages) -> int:
    return sum(steps * rows * length for steps, rows, length in stages)


def card(report: dict) -> str:
    """The model card (`README.md` beside the weights) from the report."""
    r = report["recipe"]
    b, d = r["backbone"], r["drafter"]
    n_keys = report["passkey_exact"][str(b["eval_lengths"][0])]["keys"]["n"]
    acc = report["acceptance"]
    t = report["tensors"]
    stages = ", ".join(f"{s} steps × {rows} rows × {n} tokens" for s, rows, n in b["stages"])
    share = _tokens(b["stages"]) / _tokens(longctx.RECIPE_DEFAULT.stages)
    return f"""# tiny-v41: a trained research model on the DeepSeek-V4.1 schedule

The `tiny` preset of csa2 trained on this machine's CPUs: the released model's 40-layer schedule (two sliding-window
layers, four Full, four Reindex and thirty Reuse layers, Engram at layers 1 and 14, the candidate pool sourced at
layer 20, the DSpark drafter reading layers 37, 38 and 39) at d = 64 with a byte vocabulary (259 ids: bytes, BOS,
EOS, PAD). It is a research instrument: big enough that replay windows, Top-K reads and the drafter behave as on the
release's schedule, small enough to run every experiment on a laptop. It knows no language beyond the corpus's
Python documentation and the synthetic retrieval rows it was trained on.

## Load it

```python
from csa2.checkpoints import bundled, load_hf, read_config
path = bundled("tiny-v41")
cfg, params = load_hf(path, read_config(path).replace(dtype="float32"))  # the figures below use float32 compute
```

`python -m infer --checkpoint {OUT} --dtype float32 --prompt "..."` and
`python -m infer.bench_spec --checkpoint {OUT} --dtype float32` read it too. The files are the released
DeepSeek-V4.1 layout (`config.json` with `text_config`, safetensors shards and their index), read by the same code
path as the release's own checkpoint. The tensor names are the release's: a transformers implementation of V4.1
names its parameters the same way with a `model.` prefix, `lm_head` for `head`, and `mtp.*` for the drafter. (No
transformers release up to 5.25 has a `deepseek_v41` model, so loading there is not tested.)

## Recipe

- Backbone: `train.longctx` with `LongCtxRecipe(preset="tiny", stages={tuple(map(tuple, b["stages"]))})`: {stages};
  seed {b["seed"]}, learning rate {b["lr"]} after a {b["warmup"]}-step warm-up, init std {b["initializer_range"]},
  Top-K {b["index_topk"]} and {b["candidate_topk_blocks"]} candidate blocks, SPEC §8 fake-quant (QAT) from step 0,
  the SPEC §13 indexer KL (dense for the first {b["dense_warmup_steps"]} step(s)). Rows: induction rows
  ({b["repeat_share"]:.0%}), corpus windows ({b["corpus_share"]:.0%}), the rest pass-key and multi-needle
  retrieval rows; answer digits weigh {b["answer_weight"]}. Wall time {report["backbone_train_seconds"] / 3600:.2f} h
  on 2 CPU cores (steps only; compiles excluded). The curriculum holds {share:.0%} of the tokens of the recipe's
  default one, to fit one session on this machine.
- Drafter: `train.dspark.adapt` on the frozen backbone, {d["steps"]} steps of {d["batch_size"]} rows × {d["seq_len"]}
  tokens, {d["anchors"]} anchors per row, on the backbone's greedy continuations of {d["distill_rows"]} corpus
  prompts, seed {d["seed"]}; {report["drafter_seconds"] / 60:.0f} min.
- Data: CPython's `pydoc_data.topics` (the Python documentation's topic texts, under the Python Software Foundation
  License), documents 0, 10, 20, … held out for validation; the synthetic rows are generated from seeds.
- Command: `{report["command"]}` (resumes from `runs/`).

## Figures

Measured on these files as `load_hf` reads them (FP8/FP4 weights decoded), float32 compute, SPEC §8 numerics unless
named; 95 % intervals (Wilson for shares of keys and digits, a bootstrap over batches or prompts otherwise).

Pass keys ({b["digits"]} digits) at each length, {n_keys} keys per length ({b["eval_samples"]} at each of
{len(b["eval_depths"])} depths), read teacher-forced: a key counts when every digit's argmax is right, which is what
greedy decoding produces.

{passkey_table(report)}

Validation bits per byte (n = {report["bpb"]["float"]["n"]} batches of 8 × 128 bytes): float
{interval_text(report["bpb"]["float"], '.3f')}, SPEC §8 numerics {interval_text(report["bpb"]["spec"], '.3f')}.

DSpark mean acceptance length (tokens per verify step, bonus included), γ = 5, greedy, n = {acc["prompts"]} held-out
prompts of {acc["prompt_len"]} tokens, {acc["new_tokens"]} new tokens each: {interval_text(acc["acceptance_length"])}.

## Files

{t["released_tensors"]} released tensors, {t["stored_names"]} stored names with the scales of the FP8/FP4 ones (by
stored dtype: {", ".join(f"{k} {v}" for k, v in sorted(t["by_dtype"].items()))}), {t["bytes"] / 1e6:.2f} MB in
{len(t["shards"])} shard(s).
`accuracy.json` holds every figure above with its n, the recipe and the slice the package's card-check test
reproduces.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.research_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=pathlib.Path, default=RUNS, help="training runs (backbone; drafter in RUNS-dspark)")
    ap.add_argument("--out", type=pathlib.Path, default=OUT, help="where the shipped files go (replaced)")
    args = ap.parse_args(argv)
    try:
        report = build(RECIPE, args.runs, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(passkey_table(report))
    print(json.dumps({k: report[k] for k in ("bpb", "tensors")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
