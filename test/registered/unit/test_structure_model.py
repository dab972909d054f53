"""Structure rules for the model and its runner (issue 32, target 4): no context-parallel or debug
code inline in the model or the runner.
- the KV trace, the CP padding poison and the debug checks are forward hooks from srt/debug/
  (debug/hooks.py): deepseek_v2.py names none of them;
- the CP re-layout of a batch is the attention backend's `prepare_batch`, the logits-side gather
  the CP metadata's, the MoE compaction a wrapper the CP backend installs: the model reads no CP
  state, the runner imports no CP backend and names `cp_group` at most twice;
- ForwardBatch groups its speculative (`spec`) and CP (`cp`) fields; the CP backend knows the
  draft's inputs only as `forward_batch.spec`;
- product code raises named errors (no `raise AssertionError` in the CP modules), and no function of
  the files this work touched is over 80 lines.
Pure source scans, like test_structure.py (which another area extends): fast, no package imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRT = Path(__file__).resolve().parents[3] / "python" / "sglang" / "srt"
MODEL = SRT / "models" / "deepseek_v2.py"
RUNNER = SRT / "model_executor" / "model_runner.py"
CP_FILES = [SRT / "layers" / "attention" / "nsa" / f for f in ("cp_backend.py", "cp_batch.py")]
MAX_FUNCTION_LINES = 80
# The files issue 32's target 4 moved code through: each keeps its functions short.
TOUCHED = [MODEL, RUNNER, *CP_FILES] + [SRT / f for f in (
    "models/deepseek_nextn.py", "model_executor/forward_batch_info.py", "model_executor/cuda_graph_runner.py",
    "layers/logits_processor.py", "layers/attention/attention_registry.py", "layers/attention/base_attn_backend.py",
    "layers/attention/nsa/utils.py", "mem_cache/allocator.py", "debug/hooks.py", "debug/checks.py",
    "debug/kv_trace.py", "model_loader/loader.py", "testing/multi_rank.py", "speculative/eagle_worker.py")]

DEBUG_NAMES = {"tracer", "kv_tracer", "debug_checks", "kv_trace", "cp_padding_poison", "poison",
               "assert_topk_matches_batch", "debug_checks_active"}
# what reading CP state looks like: the batch's CP group / metadata, the compute-padding rows
CP_NAMES = {"cp", "cp_metadata", "valid_idx", "dummy_idx", "cp_all_gather_hidden", "cp_collect_last_token_hidden",
            "global_batch"}


def names_used(source: str, names: set[str]) -> list[str]:
    """Every Name / Attribute / imported alias in `names`, with its line (code only: comments and
    docstrings do not count)."""
    hits = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.alias):
            name = (node.asname or node.name).split(".")[-1]
        else:
            continue
        if name in names:
            hits.add(f"line {node.lineno}: {name}")
    return sorted(hits)


def imports_of(source: str) -> list[tuple[int, str]]:
    """Modules imported anywhere in the source (module level, in functions, under TYPE_CHECKING)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    return [f"{n.name} (line {n.lineno}): {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def assertion_raises(source: str) -> list[str]:
    return [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Raise) and n.exc is not None
            and (ast.unparse(n.exc.func) if isinstance(n.exc, ast.Call) else ast.unparse(n.exc)) == "AssertionError"]


def code_mentions(source: str, text: str) -> int:
    """Occurrences of `text` in names and attributes of the code (not in comments or strings)."""
    return sum(1 for n in ast.walk(ast.parse(source))
               if (isinstance(n, ast.Attribute) and n.attr == text) or (isinstance(n, ast.Name) and n.id == text))


# -- the model --------------------------------------------------------------------------------------
def test_model_holds_no_debug_code():
    src = MODEL.read_text()
    assert not (bad := names_used(src, DEBUG_NAMES)), f"deepseek_v2.py holds debug code (debug/hooks.py): {bad}"
    bad = [f"line {ln}: {m}" for ln, m in imports_of(src) if m.startswith("sglang.srt.debug")]
    assert not bad, f"deepseek_v2.py imports srt/debug/ (the model loader installs the hooks): {bad}"


def test_model_reads_no_cp_state():
    src = MODEL.read_text()
    assert not (bad := names_used(src, CP_NAMES)), (
        f"deepseek_v2.py branches on context parallel (CP backend: prepare_batch, install_moe_compaction; "
        f"the logits processor: CPMetadata.logits_output): {bad}")
    bad = [f"line {ln}: {m}" for ln, m in imports_of(src) if ".nsa.cp_" in m]
    assert not bad, f"deepseek_v2.py imports the CP backend: {bad}"


# -- the runner -------------------------------------------------------------------------------------
def test_runner_imports_no_cp_backend_and_names_cp_group_twice_at_most():
    src = RUNNER.read_text()
    bad = [f"line {ln}: {m}" for ln, m in imports_of(src) if ".nsa.cp_" in m or m.endswith("build_cp_forward_batch")]
    assert not bad, f"model_runner.py imports the CP backend (the attention registry builds it): {bad}"
    n = code_mentions(src, "cp_group")
    assert n <= 2, f"model_runner.py names cp_group {n} times (> 2): the CP decisions belong to the CP backend"
    assert "prepare_batch" in {x.attr for x in ast.walk(ast.parse(src)) if isinstance(x, ast.Attribute)}


# -- ForwardBatch ------------------------------------------------------------------------------------
def _forward_batch_fields() -> set[str]:
    tree = ast.parse((SRT / "model_executor" / "forward_batch_info.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ForwardBatch")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_forward_batch_groups_speculative_and_cp_fields():
    fields = _forward_batch_fields()
    assert {"spec", "cp"} <= fields
    loose = sorted(f for f in fields if f.startswith(("spec_", "cp_")))
    assert not loose, f"ForwardBatch fields outside their group (SpecInput / CPBatchInfo): {loose}"


@pytest.mark.parametrize("path", CP_FILES, ids=lambda p: p.name)
def test_cp_backend_knows_draft_inputs_only_as_forward_batch_spec(path):
    src = path.read_text()
    bad = sorted({f"line {n.lineno}: {n.attr}" for n in ast.walk(ast.parse(src))
                  if isinstance(n, ast.Attribute) and n.attr.startswith("spec_")})
    assert not bad, f"{path.name} reads loose speculative fields (ForwardBatch.spec): {bad}"


# -- errors and function size ------------------------------------------------------------------------
@pytest.mark.parametrize("path", CP_FILES, ids=lambda p: p.name)
def test_cp_modules_raise_named_errors(path):
    assert not (bad := assertion_raises(path.read_text())), f"{path.name}: raise a named error: {bad}"


@pytest.mark.parametrize("path", TOUCHED, ids=lambda p: str(p.relative_to(SRT)))
def test_no_function_over_80_lines(path):
    assert not (bad := long_functions(path.read_text())), f"{path.relative_to(SRT)}: split {bad}"


# -- the scans catch what they are for ----------------------------------------------------------------
def test_scans_catch_them():
    assert names_used("if self.kv_tracer is not None:\n    self.kv_tracer.end_forward()\n", DEBUG_NAMES)
    assert names_used("from sglang.srt.debug import checks as debug_checks\n", DEBUG_NAMES)
    assert names_used("cp = forward_batch.cp.metadata\n", CP_NAMES)
    assert names_used("x = hidden.index_select(0, md.valid_idx)\n", CP_NAMES)
    assert not names_used("# the tracer and cp_metadata used to live here\nx = 1\n", DEBUG_NAMES | CP_NAMES)
    assert imports_of("def f():\n    from sglang.srt.layers.attention.nsa.cp_backend import X\n")[0][1].endswith(
        "cp_backend")
    assert code_mentions("a = self.cp_group\nif self.cp_group is None:\n    pass\n# cp_group\n", "cp_group") == 2
    assert assertion_raises("raise AssertionError('x')\n") and not assertion_raises("raise ValueError('x')\n")
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    assert long_functions(f"def f():\n{body}\n") and not long_functions("def g():\n    return 1\n")
