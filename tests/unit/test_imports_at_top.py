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


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", f"{code}\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_the_command_line_and_what_launch_checks_import_without_torch():
    """meshtrain.config, `meshtrain launch` and the CLI's parser import no torch (2 s of CPU here): the runtime
    package imports none of its modules itself, and the train command joins the process group in its run. Nor do
    each built-in model's spec, a train command's config and the shape it gives (what launch and submit check before
    any rank starts): launch refuses a bad key in a fraction of a second."""
    loaded = _modules_after("import meshtrain.config, meshtrain.commands.launch\n"
                            "from meshtrain.commands import build_parser; build_parser()\n"
                            "from meshtrain import config, registry\n"
                            "for name in ('gpt', 'llama', 'moe', 'vit'):\n"
                            "    shape = registry.get(name).shape(config.load_config(['parallel.pp=2'], name))\n"
                            "    assert shape.activations_per_token > 0, name")
    assert "torch" not in loaded


def test_a_model_built_on_meta_imports_no_compiler_and_keeps_its_shapes():
    """on_meta leaves normal_ undone on meta tensors (torch would import torch._dynamo for it, a second of CPU in a
    process that compiles nothing); the same initialiser on a real tensor still draws."""
    loaded = _modules_after("import torch\nfrom meshtrain.nn.meta import on_meta\n"
                            "from meshtrain.models.gpt.model import GPT, GPTConfig\n"
                            "with on_meta():\n    m = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=2, n_head=2, n_embd=8))\n"
                            "assert m.transformer.wte.weight.is_meta and m.transformer.wte.weight.shape == (11, 8)\n"
                            "with on_meta():\n    t = torch.nn.init.normal_(torch.zeros(3, 4, device='cpu'))\n"
                            "assert t.std() > 0")
    assert "torch._dynamo" not in loaded
