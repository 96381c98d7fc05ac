"""The package's layout bars, read from its source with `ast` (nothing is imported or run):

- no module over 600 lines, no function or method over 100 lines;
- no `from X import _private` (a private name of another module, or a private module, of
  treespec or of a third-party package) outside a short allow-list, each entry with its reason;
- no dispatch by a computed attribute name (`getattr(obj, f"run_{kind}")`): a table or a
  method says what runs.

Each failure lists every offending place as `path:line: what`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "treespec"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100

# Private modules of other packages that treespec may import, and why (keep this short).
PRIVATE_IMPORTS_ALLOWED = {
    "torch._inductor": "aoti_compile_and_package / aoti_load_package: AOTInductor's documented "
    "entry points (torch.compiler_aot_inductor) live only there",
    "torch.distributed._functional_collectives": "the traceable all-reduce that inductor compiles "
    "into a tensor-parallel graph; torch has no public traceable collective",
    "torch.utils._pytree": "an AOTInductor package's call spec, read as aoti_load_package's own "
    "wrapper reads it, beside torch._C._aoti's loader (aot.load_package: 3 s less at start)",
}


def sources() -> tuple[list[tuple[str, str, ast.Module]], list[str]]:
    """(path, text, tree) of every module, and the modules that do not parse."""
    out, broken = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        name, text = str(path.relative_to(PACKAGE.parent)), path.read_text(encoding="utf-8")
        try:
            out.append((name, text, ast.parse(text, filename=str(path))))
        except SyntaxError as e:
            broken.append(f"{name}:{e.lineno}: {e.msg}")
    return out, broken


SOURCES, UNPARSED = sources()


def private(name: str) -> bool:
    """`_x` is private; dunders (`__future__`, `__version__`) are not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def report(offences: list[str], bar: str) -> str:
    return f"{len(offences)} place(s) break the bar: {bar}\n" + "\n".join(offences)


def test_the_package_has_sources_that_parse():
    assert len(SOURCES) > 20 and any(p.endswith("decoder.py") for p, _, _ in SOURCES)
    assert not UNPARSED, report(UNPARSED, "every module parses")


def test_no_module_is_over_600_lines():
    offences = [
        f"{path}:{len(text.splitlines())}: {len(text.splitlines())} lines"
        for path, text, _ in SOURCES
        if len(text.splitlines()) > MAX_MODULE_LINES
    ]
    assert not offences, report(offences, f"a module has at most {MAX_MODULE_LINES} lines")


def test_no_function_is_over_100_lines():
    offences = []
    for path, _, tree in SOURCES:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    offences.append(f"{path}:{node.lineno}: {node.name}() has {lines} lines")
    assert not offences, report(offences, f"a function has at most {MAX_FUNCTION_LINES} lines")


def private_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) for each import of a private name or through a private module, except the
    allowed modules (`from torch._inductor import x`, `from torch.distributed import
    _functional_collectives`, `import torch._inductor`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            module = "." * node.level + (node.module or "")
            for alias in node.names:
                full = f"{module}.{alias.name}" if node.module else module + alias.name
                if any(private(p) for p in module.split(".") if p):
                    touched = module
                elif private(alias.name):
                    touched = full
                else:
                    continue
                if touched not in PRIVATE_IMPORTS_ALLOWED:
                    found.append((node.lineno, f"from {module} import {alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                private_part = any(private(p) for p in alias.name.split("."))
                if private_part and alias.name not in PRIVATE_IMPORTS_ALLOWED:
                    found.append((node.lineno, f"import {alias.name}"))
    return found


def test_no_private_name_or_module_is_imported():
    offences = [f"{path}:{line}: {what}" for path, _, tree in SOURCES for line, what in private_imports(tree)]
    assert not offences, report(
        offences, "no `from X import _private` (allowed private modules: tests/test_layout.py)"
    )


def string(node: ast.expr) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def computed_name(node: ast.expr) -> bool:
    """An attribute name built at run time from a string: an f-string, `"run_" + kind`,
    `"run_%s" % kind` or `"run_{}".format(kind)`."""
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return any(string(side) for side in (node.left, node.right))
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
        and isinstance(node.func.value, ast.Constant)
    )


def test_no_dispatch_by_a_computed_attribute_name():
    offences = []
    for path, _, tree in SOURCES:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) >= 2
                and computed_name(node.args[1])
            ):
                offences.append(f"{path}:{node.lineno}: {ast.unparse(node)[:90]}")
    assert not offences, report(offences, 'no `getattr(obj, f"...")` dispatch')


@pytest.mark.parametrize(
    "source,bad",
    [
        ("from .decoder import _walk\n", True),
        ("from treespec.backends import _cpu\n", True),
        ("import torch._dynamo\n", True),
        ("from torch.distributed import _symmetric_memory\n", True),
        ("from __future__ import annotations\nfrom treespec import __version__\n", False),
        ("from torch.distributed import _functional_collectives as funcol\n", False),
        ("from torch._inductor import aoti_load_package\n", False),
        ("from torch import nn\n", False),
    ],
)
def test_the_private_import_check_tells_them_apart(source, bad):
    assert bool(private_imports(ast.parse(source))) == bad


@pytest.mark.parametrize(
    "expr,bad",
    [
        ('getattr(self, f"_run_{kind}")', True),
        ('getattr(self, "_run_" + kind)', True),
        ('getattr(self, "run_%s" % kind)', True),
        ('getattr(self, "run_{}".format(kind))', True),
        ('getattr(self, "name")', False),
        ("getattr(args, field.name)", False),
    ],
)
def test_the_dispatch_check_tells_them_apart(expr, bad):
    call = ast.parse(expr, mode="eval").body
    assert computed_name(call.args[1]) == bad


def test_no_test_module_imports_another():
    """Shared test helpers live in helper modules (conftest, llamas, ggufs, heads, servers, toy,
    mc), never in a test module another one imports: a test file can then be moved, split or
    deselected alone."""
    tests = Path(__file__).resolve().parent
    bad = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                name = node.module.split(".")[-1]
                if name.startswith("test_") and (node.level == 1 or node.module.startswith("tests.")):
                    bad.append(f"{path.name}:{node.lineno} imports {node.module}")
    assert not bad, bad
