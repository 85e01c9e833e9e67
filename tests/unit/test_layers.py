"""The layers of docs/architecture.md hold: import-linter's contracts (.importlinter) over meshtrain's own imports.
A new import that points up a layer fails here, naming the importer, the imported module and the line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tests.conftest import REPO

# In a process of its own: import-linter's command line reconfigures logging, which later tests' caplog would miss.
pytestmark = pytest.mark.distributed


def test_every_package_imports_only_the_layers_below_it():
    pytest.importorskip("importlinter", reason="import-linter (the dev extra) is not installed")
    lint = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(REPO / '.importlinter')!r}, no_cache=True))")
    done = subprocess.run([sys.executable, "-c", lint], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout
