"""The layers of docs/architecture.md hold: import-linter's contracts (.importlinter) over meshtrain's own imports.
A new import that points up a layer, or a cost-model module that reaches for the measured side, fails here, naming
the importer, the imported module and the line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tests.conftest import REPO

# In a process of its own: import-linter's command line reconfigures logging, which later tests' caplog would miss.
pytestmark = pytest.mark.distributed


def _lint(config) -> subprocess.CompletedProcess:
    pytest.importorskip("importlinter", reason="import-linter (the dev extra) is not installed")
    lint = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True))")
    return subprocess.run([sys.executable, "-c", lint], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_every_package_imports_only_the_layers_below_it():
    done = _lint(REPO / ".importlinter")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 kept, 0 broken" in done.stdout


def test_an_arrow_up_the_layers_is_caught(tmp_path):
    """The same tool on a contract the tree breaks (the trainer does import the runtime): so the one above can fail."""
    config = tmp_path / "upside_down.ini"
    config.write_text("[importlinter]\nroot_package = meshtrain\n\n[importlinter:contract:upside-down]\n"
                      "name = upside down\ntype = layers\nlayers =\n    meshtrain.runtime\n    meshtrain.train\n")
    done = _lint(config)
    assert done.returncode == 1 and "meshtrain.train.trainer -> meshtrain.runtime" in done.stdout, done.stdout
