"""Structure rules that keep one place for each rule (DESIGN.md, Principles):
- storage (mem_cache/) imports nothing from layers/, not even inside a function;
- the CP page-map arithmetic exists once, in mem_cache/cp_page_map.py.
Pure source scans: fast, no imports of the package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRT = Path(__file__).resolve().parents[3] / "python" / "sglang" / "srt"
PAGE_MAP = SRT / "mem_cache" / "cp_page_map.py"

# `(x - 1) % cp`, `(x - 1) // cp + 1`, `(x - 1).clamp(min=0) // cp_size`, `% self.cp_size`, ... :
# a "minus one, then mod / floor-divide by the CP size" on one line re-derives page_owner /
# physical_page. Names of the CP size: anything containing "cp", or a group's world_size.
_CP_SIZE = r"(?:[A-Za-z_][\w.]*\.)?(?:\w*cp\w*|world_size)\b"
PAGE_MAP_PATTERNS = [
    re.compile(r"-\s*1\s*\)[^\n#]*?(?:%|//)\s*" + _CP_SIZE),
]


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module named by an import statement anywhere in the tree (function bodies included)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            out.append((node.lineno, str(node.args[0].value)))
    return out


def layers_imports(source: str) -> list[str]:
    hits = {ln: m for ln, m in reversed(imported_modules(ast.parse(source)))
            if m == "sglang.srt.layers" or m.startswith("sglang.srt.layers.")}
    return [f"line {ln}: {m}" for ln, m in sorted(hits.items())]


def page_map_rederivations(source: str) -> list[str]:
    hits = []
    for i, line in enumerate(source.splitlines(), 1):
        code = line.split("#", 1)[0]
        if any(p.search(code) for p in PAGE_MAP_PATTERNS):
            hits.append(f"line {i}: {line.strip()}")
    return hits


def test_mem_cache_imports_nothing_from_layers():
    files = sorted((SRT / "mem_cache").rglob("*.py"))
    assert files
    bad = {str(f.relative_to(SRT)): hits for f in files if (hits := layers_imports(f.read_text()))}
    assert not bad, f"storage must not import the attention / model layers: {bad}"


def test_page_map_formula_exists_once():
    assert page_map_rederivations(PAGE_MAP.read_text()), "the patterns no longer match the page map itself"
    bad = {}
    for f in sorted(SRT.rglob("*.py")):
        if f != PAGE_MAP and (hits := page_map_rederivations(f.read_text())):
            bad[str(f.relative_to(SRT))] = hits
    assert not bad, f"CP page-map arithmetic re-derived (use mem_cache.cp_page_map): {bad}"


# -- the scanners catch what they are meant to (and not the page-size arithmetic next to it) ------
@pytest.mark.parametrize("line", [
    "owner = (page - 1) % cp_size",
    "mine = pages[(pages - 1) % self.cp_size == o]",
    "send_pages[:n] = (vp[mine_v] - 1) // cp + 1",
    "return ((pages - 1).clamp(min=0) // cp_size + 1) * page_size + slots % page_size",
    "owner = ((local_loc // ps - 1) % cp)",
    "o = (p - 1) % group.world_size",
])
def test_page_map_scan_catches_rederivations(line):
    assert page_map_rederivations(line)


@pytest.mark.parametrize("line", [
    "fresh = [(s - 1) % p == 0 for s in seq_lens]",
    "new_page_owner((s - 1) // p, self.cp_size)",
    "ranks = [p % cp_size for p in positions]",
    "x = (n - 1) // page_size + 1",
])
def test_page_map_scan_leaves_other_arithmetic(line):
    assert not page_map_rederivations(line)


def test_import_scan_sees_function_local_imports():
    src = ("import torch\n"
           "def f():\n    from sglang.srt.layers.attention.nsa.utils import page_owner\n"
           "def g():\n    import sglang.srt.layers.linear as l\n"
           "def h():\n    importlib.import_module('sglang.srt.layers.quant')\n")
    assert len(layers_imports(src)) == 3
    assert not layers_imports("from sglang.srt.mem_cache.cp_page_map import page_owner\n")
