"""Shared test setup: float32 numerics at full matmul precision (DESIGN §6), one session fixture per preset that
tests build (`mini`, `tiny`, `v41_flash`) and session-wide parameters so each preset's `init_params` compiles once
per test run, a `mutant` monkeypatch for planted mutants, one persistent compilation cache per run, and XLA:CPU
code generation at -O0.

-O0 (`--xla_backend_optimization_level=0`, unless XLA_FLAGS already sets a level): the suite is bound by compile
time (small shapes, many programs), and LLVM's optimizations are most of it; at -O0 a compile-heavy file runs in
about two thirds of the time. The HLO and its passes (fusion, layout, buffer assignment) are the same; only the
machine code is less optimized. Test subprocesses and notebook kernels inherit it through the environment
(`csa2.mesh.simulated_cpu_env` keeps it when it adds the device count).

The cache: `fresh_compile_caches` drops every compiled program after each module, and the notebook tests run
notebooks in fresh kernels (which inherit these settings through the environment); a program compiled again
in either place loads from the run's XLA compilation cache instead of compiling. Under `pytest -n N`
(pytest-xdist, what `make test` runs) the controller creates the cache before it starts its workers, so they
inherit it and share it. It lives in a temporary directory that the process which created it removes when
the run ends, so every run starts cold, as CI does; set `JAX_COMPILATION_CACHE_DIR` to keep one across runs
instead.
"""

import gc
import os
import shutil
import tempfile

import jax
import pytest

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="csa2-xla-cache-")
# Set in the environment too, so the notebook kernels the tests start compile the same programs.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_default_matmul_precision", "highest")

from csa2 import model  # noqa: E402  (after the cache is configured: nothing may compile before)
from csa2.presets import preset  # noqa: E402

# The files that take longest, in seconds of test time (setup, call and teardown) in one `make test` run on the
# 2-core machine (2026-12-06). `pytest_collection_modifyitems` moves them to the front, longest first; under
# `--dist loadfile --no-loadscope-reorder` (the Makefile's) pytest-xdist hands files to the workers in that
# order, so the run ends on short files instead of one worker finishing a long one while the other idles.
# A stale figure only costs balance, never a test.
LONGEST_FILES = {
    "tests/test_notebooks.py": 605,
    "tests/test_isa.py": 377,
    "tests/infer/test_speculative.py": 311,
    "tests/infer/test_fuzz.py": 238,
    "tests/experiments/test_recipe_ablations.py": 230,
    "tests/csa2/test_sharding.py": 224,
    "tests/csa2/test_model.py": 220,
    "tests/train/test_memory.py": 186,
    "tests/train/test_plan.py": 186,
    "tests/csa2/test_kernel_impl.py": 185,
    "tests/csa2/test_multiprocess.py": 159,
    "tests/train/test_research_model.py": 148,
    "tests/experiments/test_qat.py": 132,
    "tests/infer/test_handoff.py": 122,
    "tests/csa2/checkpoints/test_bundled.py": 119,
    "tests/csa2/test_selection.py": 107,
    "tests/experiments/test_replay_windows.py": 104,
    "tests/infer/test_bench_model.py": 93,
    "tests/train/test_soak.py": 91,
    "tests/csa2/test_dspark.py": 87,
    "tests/infer/test_generate_sharded.py": 85,
}


def pytest_collection_modifyitems(items):
    """The longest files first (`LONGEST_FILES`); every other file after them, in collection order."""
    items.sort(key=lambda item: -LONGEST_FILES.get(item.nodeid.split("::")[0], 0))  # stable: keeps file order


@pytest.fixture(scope="session")
def mini():
    """The `mini` preset (a test that needs another config takes `mini.replace(...)`)."""
    return preset("mini")


@pytest.fixture(scope="session")
def tiny():
    return preset("tiny")


@pytest.fixture(scope="session")
def v41_flash():
    return preset("v41_flash")


@pytest.fixture(scope="session")
def mini_params(mini):
    return model.init_params(mini, jax.random.PRNGKey(0))


@pytest.fixture(scope="session")
def tiny_params(tiny):
    return model.init_params(tiny, jax.random.PRNGKey(1))


@pytest.fixture
def mutant(monkeypatch):
    """A monkeypatch for planting a mutant: csa2's jitted entry points see its changes (fresh traces), and they
    are dropped again afterwards (the programs traced under the mutant with them)."""
    jax.clear_caches()
    yield monkeypatch
    monkeypatch.undo()
    jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def fresh_compile_caches():
    """Each test module drops its compiled programs when it ends (a later module that needs one again loads it
    from the run's compilation cache). XLA:CPU maps about a thousand memory regions per compiled model
    program; a process that kept every program of the suite would pass the kernel's vm.max_map_count
    (65530) and crash inside the compiler."""
    yield
    jax.clear_caches()
    gc.collect()


def pytest_unconfigure(config):
    """The process that created the run's cache (the xdist controller, or the only process) removes it."""
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
