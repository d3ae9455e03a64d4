"""A Triton kernel may read a module-level name only if it is a `tl.constexpr(...)`: the
compiler refuses any other global ("Cannot access global variable ... from within @jit'ed
function"), while Triton's interpreter, the CPU lane's, runs it. Checked on the source, so
the CPU suite catches what otherwise fails only on a GPU."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPS = sorted((Path(__file__).parents[2] / "rlserve" / "ops").glob("*.py"))


def _plain_globals_read_by_kernels(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    plain = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            constexpr = isinstance(node.value, ast.Call) and ast.unparse(node.value.func).endswith("constexpr")
            plain |= {t.id for t in targets if isinstance(t, ast.Name) and not constexpr}
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            found += [f"{node.name} reads {n.id} (line {n.lineno})" for n in ast.walk(node)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in plain]
    return found


@pytest.mark.parametrize("path", OPS, ids=lambda p: p.name)
def test_kernels_read_only_constexpr_globals(path):
    assert _plain_globals_read_by_kernels(path) == []


def test_the_check_finds_a_plain_global(tmp_path):
    sample = tmp_path / "kernel.py"
    sample.write_text("import triton\nEPS = 1e-6\n@triton.jit\ndef k(x):\n    return x + EPS\n")
    assert _plain_globals_read_by_kernels(sample) == ["k reads EPS (line 5)"]
