"""infer.generate and the `python -m infer` CLI: jitted loop ≡ host loop, ragged rows, EOS, buckets, sampling, errors.

Compile-light: every `generate` call here shares one compiled loop (batch 2, prompt bucket 16,
capacity 32, 10 new tokens, replay window 10); the host-loop reference compiles `prefill` and
`decode_step` once each.
"""

import ast
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from csa2 import model
from csa2.checkpoints import native as checkpoint
from csa2.presets import PAD_ID, preset
from csa2.sampling import nucleus
from csa2.state import init_state
from csa2.tokenizer import decode, encode
from infer import __main__ as cli
from infer.generate import Sampling, generate, generate_loop

MINI = preset("mini")
NEW = 10
REPLAY = model.ReplayPolicy(window=10)  # row 0 (12 tokens) replays a tail, row 1 (9 tokens) runs whole
TEXTS = ("hello world", "abcdefgh")
PROMPTS = [encode(t) for t in TEXTS]  # BOS + bytes: 12 and 9 tokens, both in prompt bucket 16
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root


@pytest.fixture(scope="module")
def params(mini_params):
    """Committed to the device like restored checkpoint params, so the CLI test reuses the compiled loop."""
    return jax.device_put(mini_params, jax.devices()[0])


def _gen(params, prompts=PROMPTS, lengths=None, **kw):
    kw = {"max_new_tokens": NEW, "replay": REPLAY, "eos_id": None, **kw}
    return generate(MINI, params, prompts, lengths, **kw)


@pytest.fixture(scope="module")
def greedy(params):
    return _gen(params)


def test_greedy_equals_host_loop(params, greedy):
    """The while_loop emits exactly the tokens of prefill + argmax decode_step driven from the host."""
    n_valid = np.array([p.size for p in PROMPTS], np.int32)
    tokens = np.full((2, 16), PAD_ID, np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, :p.size] = p
    logits, state, _ = model.prefill(MINI, params, init_state(MINI, 2, 32, "fp4"), tokens, n_valid, replay=REPLAY)
    out = []
    for step in range(NEW):
        out.append(np.asarray(jnp.argmax(logits, -1), np.int32))
        if step < NEW - 1:
            logits, state = model.decode_step(MINI, params, state, out[-1])
    np.testing.assert_array_equal(greedy.tokens, np.stack(out, 1))
    np.testing.assert_array_equal(greedy.lengths, [NEW, NEW])
    # The state holds the prompt and every new token but the last: it matches the host loop's.
    np.testing.assert_array_equal(greedy.state.length, n_valid + NEW - 1)
    np.testing.assert_array_equal(greedy.state.length, state.length)
    assert len(greedy.state.global_kv) == len(state.global_kv)
    for got, want in zip(greedy.state.global_kv, state.global_kv):
        assert jax.tree.structure(got.kv) == jax.tree.structure(want.kv)
        for a, b in zip(jax.tree.leaves(got.kv), jax.tree.leaves(want.kv)):  # payload and scale bits
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_ragged_rows_equal_rows_alone_and_compile_once(params, greedy):
    """Each row of the ragged batch equals that prompt run alone (as a batch of two copies); prompts of
    the same bucket reuse the one compiled loop."""
    compiled = generate_loop.cache_size()
    for i, p in enumerate(PROMPTS):
        alone = _gen(params, [p, p])
        np.testing.assert_array_equal(alone.tokens, np.stack([greedy.tokens[i]] * 2))
    np.testing.assert_array_equal(_gen(params, PROMPTS[::-1]).tokens, greedy.tokens[::-1])
    # A [B, S] array with lengths is the same batch.
    padded = np.full((2, 13), 7, np.int32)
    for i, p in enumerate(PROMPTS):
        padded[i, :p.size] = p
    np.testing.assert_array_equal(_gen(params, padded, [p.size for p in PROMPTS]).tokens, greedy.tokens)
    assert generate_loop.cache_size() == compiled


def _early_eos(tokens):
    """(row, step k, token): a token row `row` first emits at step k < NEW − 1 and the other row never emits."""
    for row in (0, 1):
        for k in range(1, NEW - 1):
            tok = tokens[row, k]
            if tok not in tokens[row, :k] and tok not in tokens[1 - row]:
                return row, k, int(tok)
    pytest.fail(f"no usable EOS candidate in the greedy output {tokens.tolist()}")


def test_eos_stops_one_row(params, greedy):
    """EOS = the token row r emits at step k: that row ends with it (length k+1, PAD after, state length
    frozen); the other row runs on unchanged. No recompile: the EOS id is traced."""
    row, k, eos = _early_eos(greedy.tokens)
    compiled = generate_loop.cache_size()
    out = _gen(params, eos_id=eos)
    other = 1 - row
    np.testing.assert_array_equal(out.tokens[row, :k + 1], greedy.tokens[row, :k + 1])
    assert (out.tokens[row, k + 1:] == PAD_ID).all()
    np.testing.assert_array_equal(out.tokens[other], greedy.tokens[other])
    assert out.lengths[row] == k + 1 and out.lengths[other] == NEW
    assert out.state.length[row] == PROMPTS[row].size + k
    assert out.state.length[other] == PROMPTS[other].size + NEW - 1
    # Both rows end on their first token: lengths 1, nothing but the prompts in the state.
    both = _gen(params, [PROMPTS[0]] * 2, eos_id=int(greedy.tokens[0, 0]))
    np.testing.assert_array_equal(both.lengths, [1, 1])
    assert (both.tokens[:, 1:] == PAD_ID).all()
    np.testing.assert_array_equal(both.state.length, [PROMPTS[0].size] * 2)
    assert generate_loop.cache_size() == compiled


def test_sampling_is_seeded_and_tiny_top_p_is_greedy(params, greedy):
    """Temperature sampling is a pure function of the seed; top_p → 0 keeps only the argmax."""
    a = _gen(params, sampling=Sampling(temperature=1.0), seed=3)
    b = _gen(params, sampling=Sampling(temperature=1.0), seed=3)
    c = _gen(params, sampling=Sampling(temperature=1.0), seed=4)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.tokens != c.tokens).any()
    assert ((a.tokens >= 0) & (a.tokens < MINI.vocab_size)).all()
    nearly_greedy = _gen(params, sampling=Sampling(temperature=1.0, top_p=1e-6), seed=5)
    np.testing.assert_array_equal(nearly_greedy.tokens, greedy.tokens)


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    """Probabilities .5, .3, .15, .05: the nucleus grows one token each time top_p passes a cumulative sum."""
    logits = jnp.log(jnp.array([[0.05, 0.5, 0.15, 0.3]]))
    kept = lambda p: np.isfinite(np.asarray(nucleus(logits, jnp.float32(p))))[0]  # noqa: E731
    np.testing.assert_array_equal(kept(0.4), [False, True, False, False])
    np.testing.assert_array_equal(kept(0.75), [False, True, False, True])
    np.testing.assert_array_equal(kept(0.9), [False, True, True, True])
    np.testing.assert_array_equal(kept(1.0), [True, True, True, True])


@pytest.mark.parametrize("args, kwargs, match", [
    ([], {}, r"prompts=\[\]"),
    ([np.array([], np.int32)], {}, r"prompts\[0\] is empty"),
    ([np.array([1, 300], np.int32)], {}, r"prompts\[0\]: ids \[300\] are outside the vocabulary"),
    ([np.array([5]), np.array([-1])], {}, r"prompts\[1\]: ids \[-1\]"),
    ([np.array([1.0, 2.0])], {}, r"prompts\[0\]\.dtype=float64"),
    ([np.zeros(65530, np.int32)], {}, r"prompts\[0\]: 65530 prompt tokens \+ max_new_tokens=10 = 65540 positions"),
    ([np.array([1])], {"max_new_tokens": 0}, r"max_new_tokens=0"),
    ([np.array([1])], {"eos_id": 259}, r"eos_id=259"),
    # ReplayPolicy validates on construction (inside the raises block: a callable is called there)
    ([np.array([1])], {"replay": lambda: model.ReplayPolicy(window=0)}, r"ReplayPolicy\.window=0"),
    ([np.array([1])], {"replay": 10}, r"replay=10.*ReplayPolicy"),
    ([np.array([1])], {"cache_format": "fp8"}, r"cache_format='fp8'"),
    ([np.array([1])], {"seed": -1}, r"seed=-1"),
    ([np.array([1])], {"sampling": 0.5}, r"sampling=0\.5"),
    (np.ones((2, 4), np.int32), {"lengths": [4, 5]}, r"lengths=\[4, 5\]"),
    (np.ones((2, 4), np.int32), {"lengths": [0, 4]}, r"lengths=\[0, 4\]"),
    (np.ones(4, np.int32), {}, r"prompts\.shape=\(4,\)"),
])
def test_bad_input_raises_value_error(params, args, kwargs, match):
    """Rejected on the host before anything compiles, with the field and the value in the message."""
    kwargs = {"max_new_tokens": NEW, **kwargs}
    lengths = kwargs.pop("lengths", None)
    with pytest.raises(ValueError, match=match):
        generate(MINI, params, args, lengths, **{k: v() if callable(v) else v for k, v in kwargs.items()})


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.5}, r"Sampling\.temperature=-0\.5"),
    ({"temperature": float("nan")}, r"Sampling\.temperature=nan"),
    ({"top_p": 0.0}, r"Sampling\.top_p=0\.0"),
    ({"top_p": 1.5}, r"Sampling\.top_p=1\.5"),
])
def test_bad_sampling_raises_value_error(kwargs, match):
    """Sampling validates on construction."""
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


# ---------------------------------------------------------------- CLI

@pytest.fixture(scope="module")
def ckpt(params, tmp_path_factory):
    """A mini checkpoint of the module's params (restored params come back committed, like `params`)."""
    directory = tmp_path_factory.mktemp("infer") / "run"
    checkpoint.save(directory, 1, params=params, opt_state=optax.sgd(1e-3).init(params), data_step=0,
                    rng=jax.random.PRNGKey(0), cfg=MINI)
    return directory


def _cli(capsys, *argv):
    """Run the CLI in-process: (exit status, stdout, stderr)."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_missing_checkpoint_exits_2_without_traceback(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "infer", "--checkpoint", tmp_path / "nope", "--prompt", "hi"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: checkpoint directory") and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_cli_input_errors_exit_2(capsys, ckpt, tmp_path):
    """Non-UTF-8 batch file, prompt too long, no checkpoint in the directory, no prompt: one error line, exit 2."""
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"fine\n\xff\xfe broken\n")
    code, out, err = _cli(capsys, "--checkpoint", ckpt, "--batch-file", bad)
    assert code == 2 and err.startswith("error: ") and f"{bad}:2" in err and "UTF-8" in err and out == ""
    code, _, err = _cli(capsys, "--checkpoint", ckpt, "--prompt", "a" * 65536)
    assert code == 2 and err.startswith("error: prompts[0]: 65537 prompt tokens")
    code, _, err = _cli(capsys, "--checkpoint", tmp_path, "--prompt", "hi")
    assert code == 2 and "holds no checkpoints" in err
    code, _, err = _cli(capsys, "--checkpoint", ckpt)
    assert code == 2 and err.startswith("error: no prompts")


def test_cli_prints_continuations_and_throughput(capsys, ckpt, greedy, tmp_path):
    """End to end from a saved checkpoint, same bucket as above (no new compile): the greedy texts."""
    batch = tmp_path / "batch.txt"
    batch.write_text(TEXTS[1] + "\n\n")
    code, out, err = _cli(capsys, "--checkpoint", ckpt, "--prompt", TEXTS[0], "--batch-file", batch,
                          "--max-new-tokens", NEW, "--replay-window", REPLAY.window)
    assert code == 0, err
    texts, stats = out.removesuffix("\n").rsplit("\n", 1)
    assert stats.startswith("compile ") and "tokens/s" in stats and "prompt bucket 16, capacity 32" in stats
    assert texts == "\n".join(f"[{i}] {decode(t)}" for i, t in enumerate(greedy.tokens))


# ---------------------------------------------------------------- import direction

def _imports(path):
    """Top-level module names imported anywhere in the file (absolute imports; relative ones as '.')."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." if node.level else node.module.split(".")[0])
    return names


def test_infer_never_imports_train():
    """Inference sits below training: no module of infer/ imports `train` (the demo driver lives in train/)."""
    files = sorted(pathlib.Path(ROOT, "infer").rglob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "__main__.py", "generate.py"}
    offending = {str(f.relative_to(ROOT)): names for f in files if "train" in (names := _imports(f))}
    assert offending == {}
    for f in files:  # the text check catches imports the AST walk could miss (e.g. importlib strings)
        text = f.read_text()
        assert "import train" not in text and "from train" not in text, f
    assert not pathlib.Path(ROOT, "infer", "demo.py").exists() and pathlib.Path(ROOT, "train", "demo.py").exists()
