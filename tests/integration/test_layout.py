"""The package's form, read from its source: no import circle, imports that run downward through the layers of the
pipeline, files of at most 600 lines and functions of at most 80, the few options `OasisCache` takes by name, nothing
of torch assigned to, and a project that describes the product rather than how it was built."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from oasis_cache import OasisCache

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "oasis_cache"
# lowest first: a module imports only from its own rank or below (`draft/train.py` is a command: it loads models)
RANKS = {"compat": 0, "config": 0, "stats": 0, "kernels": 1, "memory": 2, "pools": 3, "control": 4, "compute": 5,
         "layer": 6, "window": 6, "hybrid": 6, "undo": 7, "draft": 7, "runtime": 8, "cache": 9, "warm": 10,
         "plot": 10, "remote": 10, "integrations": 10, "loaders": 10, "draft.train": 10}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The package's modules `name` imports, anywhere in it (inside functions too), but for annotations only
    (`if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for branch in ast.walk(tree) if isinstance(branch, ast.If)
               and getattr(branch.test, "id", None) == "TYPE_CHECKING" for node in ast.walk(branch)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + [node.module] if node.module else base) if node.level else node.module or ""
            for alias in node.names:
                module = f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target
                if module in modules and module != name:
                    found.add(module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules and alias.name != name)
    return found


def _rank(module: str) -> int:
    parts = module.split(".")[1:]
    if not parts:
        return 99  # (the package's `__init__`: above everything)
    return RANKS.get(".".join(parts[:2]), RANKS.get(parts[0], 11))


def test_no_import_circle_and_imports_run_downward():
    modules = _modules()
    edges = {name: _imports(name, path, modules) for name, path in modules.items()}
    upward = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if _rank(b) > _rank(a))
    assert not upward, upward
    state: dict[str, int] = {}

    def visit(module, trail):
        state[module] = 1
        for target in edges[module]:
            if state.get(target) == 1:
                raise AssertionError("import circle: " + " -> ".join(trail[trail.index(target):] + [target]))
            if target not in state:
                visit(target, trail + [target])
        state[module] = 2

    for module in modules:
        if module not in state:
            visit(module, [module])


def test_no_file_over_600_lines_and_no_function_over_80():
    long_files, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 600:
            long_files.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long_files and not long_functions, (long_files, long_functions)


def test_oasis_cache_takes_at_most_eight_options_by_name():
    """Options a user sets by name, at most 8; the rest inside `advanced={...}`."""
    named = [p.name for p in inspect.signature(OasisCache.__init__).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert "advanced" in named and len(named) - 1 <= 8, named


def test_nothing_of_torch_is_assigned_to():
    """No `torch.X.y = ...` nor `setattr(torch..., ...)` in the package (patching torch for the process)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
                targets = [node.args[0]]
            for target in targets:
                while isinstance(target, ast.Attribute):
                    target = target.value
                if isinstance(target, ast.Name) and target.id == "torch" and target is not node:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_the_project_describes_the_product_not_its_making():
    """No narration of how it was built (work sessions, issue numbers) in the package, README, docs, examples, bench,
    eval or tests."""
    pattern = re.compile(r"\b(this|last|next|previous|earlier|a later) session\b|\bsession \d|\bissue #?\d+|#\d{2,3}\b",
                         re.IGNORECASE)
    places = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *PACKAGE.rglob("*.py"),
              *(ROOT / "examples").glob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "eval").glob("*.py"),
              *(ROOT / "tests").rglob("*.py")]
    found = [f"{path.relative_to(ROOT)}:{number}" for path in places if path != Path(__file__).resolve()
             for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found
