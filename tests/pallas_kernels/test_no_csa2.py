"""The kernel tests stand alone: every module under tests/pallas_kernels imports only pallas_kernels, this
package, jax, numpy, ml_dtypes, pytest and the standard library (never csa2: one implementation per op)."""

import ast
import pathlib
import sys

ALLOWED = {"pallas_kernels", "tests", "jax", "numpy", "ml_dtypes", "pytest"}


def test_kernel_tests_import_no_model_code():
    here = pathlib.Path(__file__).parent
    files = sorted(here.glob("*.py"))
    assert len(files) > 5
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}: relative import"
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in ALLOWED or top in sys.stdlib_module_names, f"{path.name} imports {name}"
                if top == "tests":
                    assert name.startswith("tests.pallas_kernels"), f"{path.name} imports {name}"
