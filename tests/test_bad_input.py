"""The catalogue of bad input (docs/errors.md): each kind is refused with a message naming the field, the value and
the fix; a CLI prints it as one `error:` line and exits with status 2, and writes nothing. The table in
docs/errors.md lists exactly these cases (a test checks it), so the catalogue cannot drift from what is tested.

Every case is refused before anything compiles: the checks run on the host, at the public boundary."""

import dataclasses
import io
import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"


def _preset(name):
    from csa2.presets import preset
    return preset(name)


def _mini():
    return _preset("mini")


def _bundled() -> str:
    from csa2.checkpoints import bundled
    return str(bundled())


def _plan(**kw):
    from infer.generate import plan
    args = dict(prompts=[np.array([1, 2, 3])], max_new_tokens=4) | kw
    return plan(_mini(), args.pop("prompts"), **args)


def _sampling(**kw):
    from infer.generate import Sampling
    return Sampling(**kw)


def _state(**kw):
    from csa2.state import init_state
    return init_state(_mini(), **({"batch": 1, "capacity": 64} | kw))


def _replay(**kw):
    from csa2.replay import ReplayPolicy
    return ReplayPolicy(**kw).check(_mini())


def _prefix_cache(**kw):
    from infer.prefix_cache import PrefixCache
    return PrefixCache(_mini(), **kw)


def _restore(directory, **kw):
    from csa2.checkpoints import native
    return native.restore_params(directory, **kw)


def _decode_part(message):
    from infer import wire
    return wire.decode_part(message)


def _parse_mesh(text):
    from train.plan import parse_mesh
    return parse_mesh(text)


def _sps(**kw):
    from infer.schedule import SpsTable
    return SpsTable(**({"widths": (1, 2), "steps_per_s": {1: (1.0, 2.0)}, "meta": {}} | kw))


def _config(**kw):
    return dataclasses.replace(_mini(), **kw)


def _handoff_rows():
    from csa2.state import init_state
    from infer import handoff
    return handoff.package(_mini(), init_state(_mini(), 2, 64), [0, 0])


def _compile_cache_empty(monkeypatch):
    from csa2 import compile_cache
    monkeypatch.setenv(compile_cache.ENV, "")
    return compile_cache.enable()


# (id, call taking (tmp_path, monkeypatch), the message it must contain as a regex)
LIBRARY = [
    ("unknown preset", lambda t, m: _preset("big"), "unknown name 'big'"),
    ("config field out of range", lambda t, m: _config(sliding_window=0), "sliding_window=0: must be a positive"),
    ("state batch of zero", lambda t, m: _state(batch=0), "batch=0 must be a positive integer"),
    ("state capacity not a multiple of the ratios", lambda t, m: _state(capacity=63), "capacity=63 must be a positive "
                                                                                     "multiple of 2"),
    ("state capacity beyond max_position_embeddings", lambda t, m: _state(capacity=1 << 20),
     "exceeds max_position_embeddings"),
    ("unknown cache format", lambda t, m: _state(cache_format="fp8"), "cache_format='fp8'; use one of"),
    ("replay split before the decoder", lambda t, m: _replay(window=16, split_layer=1), "split_layer=1: must lie in"),
    ("max_new_tokens of zero", lambda t, m: _plan(max_new_tokens=0), "max_new_tokens=0: must be an integer ≥ 1"),
    ("negative temperature", lambda t, m: _sampling(temperature=-1.0), "temperature=-1.0: use a finite number ≥ 0"),
    ("top_p of zero", lambda t, m: _sampling(top_p=0.0), "top_p=0.0: use a number in \\(0, 1\\]"),
    ("EOS id outside the vocabulary", lambda t, m: _plan(eos_id=10**6), "eos_id=1000000: must be a token id"),
    ("seed outside 32 bits", lambda t, m: _plan(seed=-1), "seed=-1: must be an integer in \\[0, 2\\*\\*32\\)"),
    ("prompt id outside the vocabulary", lambda t, m: _plan(prompts=[np.array([1, 999])]),
     "prompts\\[0\\]: ids \\[999\\] are outside the vocabulary"),
    ("empty prompt", lambda t, m: _plan(prompts=[np.array([], np.int32)]), "prompts\\[0\\] is empty"),
    ("no prompts", lambda t, m: _plan(prompts=[]), "prompts=\\[\\]: give at least one prompt"),
    ("prompt plus budget beyond the positions", lambda t, m: _plan(max_new_tokens=1 << 20),
     "exceed .* shorten the prompt or lower max_new_tokens"),
    ("prefix store of no records", lambda t, m: _prefix_cache(records=0), "PrefixCache.records=0: use an integer ≥ 1"),
    ("unknown numerics", lambda t, m: _plan(numerics="half"), "numerics='half': use one of"),
    ("float numerics on a packed cache", lambda t, m: _plan(numerics="float", cache_format="fp4"),
     "numerics='float' with cache_format='fp4'"),
    ("checkpoint directory missing", lambda t, m: _restore(t / "none"), "does not exist; train first"),
    ("checkpoint kind unknown", lambda t, m: _restore(t, kind="adapter"), "kind='adapter': a checkpoint holds one of"),
    ("SPS table without rates", lambda t, m: _sps(steps_per_s={}), "SpsTable.steps_per_s=\\{\\}"),
    ("mesh axis without a size", lambda t, m: _parse_mesh("data=x"), "data=x"),
    ("handoff of a repeated row", lambda t, m: _handoff_rows(), "rows=\\[0, 0\\]: distinct slots"),
    ("handoff message that is not one", lambda t, m: _decode_part(b"hello"), "does not start with b'CSA2PART'"),
    ("empty compile cache variable", lambda t, m: _compile_cache_empty(m), "compile cache: empty value"),
]


def _write(path: pathlib.Path, data: bytes) -> pathlib.Path:
    path.write_bytes(data)
    return path


# (id, module, argv taking tmp_path, the message)
CLI = [
    ("infer: missing checkpoint", "infer.__main__", lambda t: ["--checkpoint", str(t / "none"), "--prompt", "x"],
     "checkpoint directory .* does not exist"),
    ("infer: prompt file not UTF-8", "infer.__main__",
     lambda t: ["--checkpoint", str(t), "--batch-file", str(_write(t / "p.txt", b"\xff\xfe"))], "is not valid UTF-8"),
    ("infer: prompt file missing", "infer.__main__",
     lambda t: ["--checkpoint", str(t), "--batch-file", str(t / "gone.txt")], "gone.txt: no such file or directory; "
                                                                               "pass a UTF-8 text file"),
    ("infer: no prompts", "infer.__main__", lambda t: ["--checkpoint", str(t)], "no prompts"),
    ("train: no --out", "train.__main__", lambda t: ["--steps", "1"], "--out is required"),
    ("train: unknown preset", "train.__main__", lambda t: ["--out", str(t / "run"), "--preset", "big"],
     "unknown name 'big'"),
    ("train: --float with --qat-from", "train.__main__",
     lambda t: ["--out", str(t / "run"), "--float", "--qat-from", "3"], "qat"),
    ("train.dspark: missing backbone", "train.dspark", lambda t: ["--backbone", str(t / "none"), "--out",
                                                                 str(t / "run")], "no such directory"),
    ("csa2 convert: missing released directory", "csa2.cli",
     lambda t: ["convert", "from-hf", str(t / "none"), str(t / "run")], "none: no config.json"),
    ("infer.bench_spec: missing checkpoint", "infer.bench_spec", lambda t: ["--checkpoint", str(t / "none")],
     "--checkpoint .*/none: no such directory"),
    ("infer: --step of a released checkpoint", "infer.__main__",
     lambda t: ["--checkpoint", _bundled(), "--step", "3", "--prompt", "x"], "step=3: .* is a released checkpoint"),
    ("infer.bench_spec: --drafter beside a released checkpoint", "infer.bench_spec",
     lambda t: ["--checkpoint", _bundled(), "--drafter", str(t)], "carries its drafter"),
    ("train.bench: batch of zero", "train.bench", lambda t: ["--batch-size", "0"], "must be ≥ 1"),
    ("infer.bench_model: zero reps", "infer.bench_model", lambda t: ["--reps", "0"], "must be ≥ 1"),
    ("infer.fuzz: odd rows", "infer.fuzz.__main__", lambda t: ["--rows", "3"], "--rows 3"),
    ("train.retrieval_curve: no run", "train.retrieval_curve", lambda t: [str(t)], "no recipe.json"),
    ("train.retrieval_curve: zero samples", "train.retrieval_curve", lambda t: [str(t), "--samples", "0"],
     "--samples 0: read at least 1 key"),
]


@pytest.mark.parametrize("name", [c[0] for c in LIBRARY])
def test_library_input_is_refused_by_name(name, tmp_path, monkeypatch):
    _, call, message = next(c for c in LIBRARY if c[0] == name)
    with pytest.raises(ValueError, match=message):
        call(tmp_path, monkeypatch)


@pytest.mark.parametrize("name", [c[0] for c in CLI])
def test_cli_input_is_one_error_line_status_2_and_nothing_written(name, tmp_path, monkeypatch):
    _, module, argv, message = next(c for c in CLI if c[0] == name)
    argv = argv(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    try:
        code = __import__(module, fromlist=["main"]).main(argv)
    except SystemExit as exit_:
        code = exit_.code
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert code == 2, (code, lines)
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), lines
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_the_catalogue_in_docs_lists_exactly_these_cases():
    """docs/errors.md has one table row per case, named as here."""
    rows = [line.split("|")[1].strip().strip("`") for line in DOC.read_text(encoding="utf-8").splitlines()
            if line.startswith("| ") and not line.startswith("| input") and not line.startswith("|---")]
    assert rows == [c[0] for c in LIBRARY] + [c[0] for c in CLI]
    assert len(rows) >= 30
