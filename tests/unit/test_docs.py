"""The API reference (`make docs`): pdoc builds it from meshtrain's public API without a warning, and it documents
every public name; the changelog's newest release is the version the package carries."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import meshtrain

pdoc = pytest.importorskip("pdoc", reason="pdoc is not installed: the dev extra carries it (make test installs it)")

REPO = Path(__file__).resolve().parents[2]
# As `make docs` runs it: the package itself, its submodules left out (they are internal, and some import optional
# dependencies such as deepspeed or nvidia.dali).
DOC_SPECS = ("meshtrain", r"!meshtrain\.")


def public_names() -> list[str]:
    __tracebackhide__ = True
    names = getattr(meshtrain, "__all__", None)
    assert names, "meshtrain has no __all__: the public API, and so its reference, is what meshtrain.__all__ lists"
    return list(names)


@pytest.fixture(scope="module")
def api_reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("api")
    with pytest.MonkeyPatch.context() as env, warnings.catch_warnings():
        env.setenv("PDOC_ALLOW_EXEC", "1")  # as `make docs`: h5py runs `uname -p` when imported
        warnings.simplefilter("error")  # a docstring pdoc cannot read, or a name it cannot resolve, fails the build
        pdoc.pdoc(*DOC_SPECS, output_directory=out)
    return out


def test_the_reference_opens_on_the_package_page(api_reference):
    index = (api_reference / "index.html").read_text()
    assert 'url=./meshtrain.html"' in index, "one module documented: the index forwards to its page"
    assert sorted(p.name for p in api_reference.glob("*.html")) == ["index.html", "meshtrain.html"], \
        "internal submodules have no page of their own"


def test_every_public_name_has_its_section(api_reference):
    page = (api_reference / "meshtrain.html").read_text()
    sections = set(re.findall(r'<section id="([^"]+)"', page))
    missing = [name for name in public_names() if name not in sections]
    assert not missing, f"meshtrain.__all__ names {missing}, which the reference does not document"


def test_every_public_class_and_function_says_what_it_does():
    # pdoc's view, not inspect's: a dataclass's generated "DistInfo(rank: int, ...)" is no documentation.
    module = pdoc.doc.Module(meshtrain)
    undocumented = [name for name in public_names()
                    if isinstance(member := module.get(name), pdoc.doc.Class | pdoc.doc.Function)
                    and not member.docstring.strip()]
    assert not undocumented, f"public names without a docstring: {undocumented}"


def test_the_changelog_newest_release_is_the_package_version():
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+[^\]]*)\]", (REPO / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert releases, "CHANGELOG.md has no '## [X.Y.Z]' release heading"
    assert releases[0] == meshtrain.__version__, \
        f"CHANGELOG.md's newest release is {releases[0]}, but meshtrain.__version__ is {meshtrain.__version__}"
