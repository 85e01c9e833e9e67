"""Imports inside functions only where they keep a module light: a module that already imports torch at its top
has no reason to import meshtrain's own modules late (docs/architecture.md, "Imports")."""

import ast
from pathlib import Path

from tests.conftest import REPO

SRC = REPO / "src" / "meshtrain"


def _imports_torch_at_top(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def late_imports(path: Path, root: Path = SRC) -> list[str]:
    """'module.function: meshtrain.x' for each import of a meshtrain module inside a function of a module that
    imports torch at its top."""
    tree = ast.parse(path.read_text())
    if not _imports_torch_at_top(tree):
        return []
    found = []
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("meshtrain"):
                    found.append(f"{path.relative_to(root)}:{function.name}: {node.module}")
    return found


def test_modules_that_import_torch_import_their_own_package_at_the_top():
    late = [line for path in sorted(SRC.rglob("*.py")) for line in late_imports(path)]
    assert late == [], "move these imports to the module's top (no loop needs them there):\n" + "\n".join(late)


def test_the_check_finds_a_late_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import torch\n\n\ndef f():\n    from meshtrain.parallel import mesh\n    return mesh\n")
    assert late_imports(module, tmp_path) == ["m.py:f: meshtrain.parallel"]
    module.write_text("import json\n\n\ndef f():\n    from meshtrain.parallel import mesh\n    return mesh\n")
    assert late_imports(module, tmp_path) == [], "a module without torch at its top may stay light"
