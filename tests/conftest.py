"""Shared test setup: float32 numerics at full matmul precision (DESIGN §6) and session-wide parameters,
so each preset's `init_params` compiles once per test run."""

import gc

import jax
import pytest

from csa2 import model
from csa2.config import preset

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def mini_params():
    return model.init_params(preset("mini"), jax.random.PRNGKey(0))


@pytest.fixture(scope="session")
def tiny_params():
    return model.init_params(preset("tiny"), jax.random.PRNGKey(1))


@pytest.fixture(autouse=True, scope="module")
def fresh_compile_caches():
    """Each test module compiles afresh. XLA:CPU maps about a thousand memory regions per compiled model
    program; a process that kept every program of the suite would pass the kernel's vm.max_map_count
    (65530) and crash inside the compiler."""
    yield
    jax.clear_caches()
    gc.collect()
