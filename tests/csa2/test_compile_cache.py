"""The CLIs' persistent compilation cache: where it goes (flag, variable, JAX's own, the user cache) and its off
switch. The suite itself runs with a cache of its own (tests/conftest.py), which these tests put back."""

import jax
import pytest

from csa2 import compile_cache
from csa2.compile_cache import ENV, OFF, default_dir, enable, resolve


@pytest.fixture
def jax_cache(monkeypatch, tmp_path):
    """No cache given to JAX and no variable set; the suite's settings restored afterwards."""
    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    jax.config.update("jax_compilation_cache_dir", None)
    yield tmp_path
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


def test_the_flag_then_the_variable_then_jaxs_own_then_the_user_cache(jax_cache, monkeypatch):
    assert default_dir() == jax_cache / "xdg" / "csa2" / "xla"
    assert resolve() == default_dir()
    assert resolve(fallback=False) is None  # benchmarks: no default directory
    monkeypatch.setenv(ENV, str(jax_cache / "from-env"))
    assert resolve() == jax_cache / "from-env" and resolve(fallback=False) == jax_cache / "from-env"
    assert resolve(str(jax_cache / "from-flag")) == jax_cache / "from-flag"
    monkeypatch.delenv(ENV)
    jax.config.update("jax_compilation_cache_dir", str(jax_cache / "jax-own"))
    assert resolve() is None  # JAX's own directory is left alone


def test_enable_turns_it_on_and_off(jax_cache, monkeypatch):
    assert enable() == str(default_dir()) and default_dir().is_dir()
    assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.MIN_COMPILE_S
    assert enable(OFF) is None
    monkeypatch.setenv(ENV, OFF)
    jax.config.update("jax_compilation_cache_dir", str(jax_cache / "jax-own"))
    assert enable() is None  # the variable's off wins over JAX's own setting
    assert enable(str(jax_cache / "mine")) == str(jax_cache / "mine")  # and the flag over the variable


def test_an_empty_value_is_refused(jax_cache, monkeypatch):
    with pytest.raises(ValueError, match="compile cache: empty value"):
        resolve(" ")
    monkeypatch.setenv(ENV, "")
    with pytest.raises(ValueError, match="give a directory or 'off'"):
        enable()


@pytest.mark.parametrize("module", ["infer.__main__", "train.__main__", "train.demo", "infer.bench_spec",
                                    "infer.bench_model", "train.bench", "experiments.notebooks"])
def test_every_cli_takes_the_flag(module, capsys):
    """Each CLI's --help names --compile-cache (the benchmarks without a default directory)."""
    cli = __import__(module, fromlist=["main"])
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--compile-cache DIR|off" in text
    bench = module in ("infer.bench_model", "train.bench")
    assert ("else off" in text) == bench and (str(default_dir()) in text) != bench


@pytest.mark.parametrize("module", ["train.demo", "infer.bench_model", "train.bench", "infer.pd",
                                    "infer.bench_handoff"])
def test_a_cli_refuses_an_empty_value_with_one_error_line(module, jax_cache, monkeypatch, capsys):
    """The CLIs that enable the cache before anything else (`enable_cli`): status 2 and an `error:` line, no
    traceback (the others catch ValueError in their own error handling)."""
    monkeypatch.setenv(ENV, "")
    cli = __import__(module, fromlist=["main"])
    with pytest.raises(SystemExit) as exit_:
        cli.main([])
    assert exit_.value.code == 2
    assert "error: compile cache: empty value" in capsys.readouterr().err
