"""Dispatch: `impl="auto"` picks the backend for the platform, and each kernel picks its lowering (the
interpreter on CPU, Triton on GPU, Mosaic on TPU, else a clear error)."""

import jax
import numpy as np
import pytest

from pallas_kernels import _common, ops, reference
from tests.pallas_kernels.cases import indexer_case


@pytest.mark.parametrize("backend,want", [("cpu", "dense"), ("gpu", "pallas"), ("cuda", "pallas"), ("tpu", "pallas")])
def test_auto_is_the_dense_reads_on_cpu_and_the_kernels_elsewhere(backend, want):
    assert ops.resolve_impl("auto", backend) == want
    for impl in ops.IMPLS:
        assert ops.resolve_impl(impl, backend) == impl


def test_auto_runs_the_reference_here_and_bad_impls_are_refused():
    q, w, ikey, _, visible = indexer_case(3, b=1, s=2, hi=2, di=32, n=9, pool=4)
    np.testing.assert_array_equal(ops.indexer_scores(q, w, ikey, visible, impl="auto"),
                                  reference.indexer_scores(q, w, ikey, visible))
    with pytest.raises(ValueError, match=r"impl='mosaic': expected one of \('xla', 'pallas', 'dense', 'auto'\)"):
        ops.indexer_scores(q, w, ikey, visible, impl="mosaic")


@pytest.mark.parametrize("backend,interpret,want", [
    ("cpu", None, "interpret"), ("cpu", True, "interpret"), ("gpu", None, "triton"), ("cuda", False, "triton"),
    ("tpu", None, "mosaic"), ("tpu", True, "interpret"),
])
def test_each_kernel_picks_its_lowering(monkeypatch, backend, interpret, want):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert _common.resolve_target(interpret, "k") == want


@pytest.mark.parametrize("backend", ["cpu", "metal"])
def test_a_platform_without_a_kernel_lowering_is_refused_by_name(monkeypatch, backend):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    with pytest.raises(NotImplementedError, match=rf"pallas_kernels.sparse_attention compiles for GPU \(Triton\) "
                                                  rf"and TPU \(Mosaic\) only; backend='{backend}'. Use impl='xla'"):
        _common.resolve_target(False, "sparse_attention")
