"""The README and docs/ hold together: every relative link and every path they name exists (anchors included,
as GitHub writes them), every page is reachable from the README, the README stays a five-minute read, and every
`meshtrain …` line in a bash block parses against the command's own parser (test_docs_run.py runs them all)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
from tests.conftest import REPO, clean_env, output

from meshtrain import commands, registry

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 200

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# A path named in the text, from the repository root: docs/plan.md, benchmarks/layouts.py, tests/gpu, ...
BARE_PATH = re.compile(r"(?<![\w./-])((?:docs|benchmarks|examples|tests|src)/[\w./*-]*[\w*/])")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
BASH = {"bash", "sh", "shell"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def prose(text: str) -> str:
    """The text that renders as prose: no fenced blocks, no code spans (a `[x](y)` there is no link)."""
    return CODE_SPAN.sub("", without_code_blocks(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: Counter[str] = Counter()
    found = set()
    for _, title in HEADING.findall(without_code_blocks(page.read_text())):
        base = slug(title)
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return frozenset(found)


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not ours to check


def link_target(page: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return (page.parent / path).resolve() if path else page, anchor


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, anchor = link_target(page, target)
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no heading '#{anchor}' in {rel(path)})")
    assert not broken, f"{rel(page)} links to what is not there: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_path_named_exists(page):
    missing = sorted({name for name in BARE_PATH.findall(page.read_text())
                      if not any(REPO.glob(name.rstrip("/")))})
    assert not missing, f"{rel(page)} names paths that do not exist: {missing}"


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for target in links(page):
            path, _ = link_target(page, target)
            if path.suffix == ".md" and path.exists() and path not in reached:
                reached.add(path)
                todo.append(path)
    unreached = [rel(p) for p in PAGES if p not in reached]
    assert not unreached, f"no chain of links from README.md reaches {unreached}"


def drawn_tree() -> set[str]:
    """The modules architecture.md's tree lists, as paths under src/meshtrain (two spaces of indent per folder)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("## The tree", 1)[1].split("```", 2)[1]
    listed, folders = set(), []
    for line in block.splitlines():
        if not line.strip():
            continue
        depth, name = (len(line) - len(line.lstrip())) // 2, line.split()[0]
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
            listed.add("/".join([*folders, "__init__.py"]))
        else:
            listed.add("/".join([*folders, name]))
    return listed


def test_the_architecture_tree_lists_every_module():
    source = REPO / "src" / "meshtrain"
    modules = {str(p.relative_to(source)) for p in source.rglob("*.py")}
    drawn = drawn_tree()
    assert modules == drawn, (f"docs/architecture.md's tree misses {sorted(modules - drawn)} and lists what is gone: "
                              f"{sorted(drawn - modules)}")


def test_the_readme_is_a_five_minute_read():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, \
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the reference into a docs/ page and link it"


# ---- the command lines the pages show ----

def command_lines(text: str) -> list[str]:
    """The logical lines of every bash block: continuations joined."""
    lines = []
    for lang, body in FENCE.findall(text):
        if lang in BASH:
            lines += [line.strip() for line in body.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def simple_commands(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, words = [], []
    for word in lexer:
        if word in SEPARATORS:
            commands.append(words)
            words = []
        else:
            words.append(word)
    return [c for c in [*commands, words] if c]


def meshtrain_argv(words: list[str]) -> list[str] | None:
    """The arguments meshtrain gets in `meshtrain …`, `python -m meshtrain …`, `torchrun … -m meshtrain …`."""
    while words and ASSIGNMENT.match(words[0]):  # VAR=value meshtrain …
        words = words[1:]
    if words and Path(words[0]).name == "meshtrain":
        return words[1:]
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[i + 1] == "meshtrain":
            return words[i + 2:]
    return None


def invocations() -> list[tuple[str, tuple[str, ...]]]:
    """(page, argv) of every meshtrain invocation in a bash block, the command after a launch's `--` included."""
    found = []
    for page in PAGES:
        for line in command_lines(page.read_text()):
            for words in simple_commands(line):
                argv = meshtrain_argv(words)
                while argv is not None:
                    found.append((rel(page), tuple(argv)))
                    inner = argv[argv.index("--") + 1:] if argv[:1] == ["launch"] and "--" in argv else []
                    argv = meshtrain_argv(inner)
    return found


INVOCATIONS = invocations()


def subcommand(argv) -> str | None:
    return next((word for word in argv if not word.startswith("-")), None)


def test_the_pages_show_every_command():
    shown = {subcommand(argv) for _, argv in INVOCATIONS}
    assert shown >= set(commands.SUBCOMMANDS), \
        f"no bash block runs meshtrain {sorted(set(commands.SUBCOMMANDS) - shown)}"
    assert any(subcommand(argv) == "launch" and "--" in argv for _, argv in INVOCATIONS), \
        "no bash block shows `meshtrain launch … -- …`"


@pytest.mark.parametrize("page,argv", INVOCATIONS, ids=[" ".join(argv)[:70] for _, argv in INVOCATIONS])
def test_every_command_line_parses(page, argv):
    name = subcommand(argv)
    assert name in commands.SUBCOMMANDS, f"{page}: `meshtrain {' '.join(argv)}`: no subcommand {name!r}"
    parser = commands.build_parser(name)  # imports that command's module and adds its options, as `meshtrain` does
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as e:
        pytest.fail(f"{page}: `meshtrain {' '.join(argv)}` does not parse (argparse exit {e.code}; message above)")
    model = getattr(args, "workload", None) if name in ("train", "plan") else None
    if model is not None:
        assert model in registry.names() or ":" in model, \
            f"{page}: `meshtrain {' '.join(argv)}`: no model {model!r} (there are {registry.names()})"


BENCHMARK_SCRIPTS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if "__main__" in p.read_text())
HELP_EACH = """
import contextlib, io, os, runpy, sys
sys.path.insert(0, "")
for script in sys.argv[1:]:
    sys.path[0], sys.argv, out = os.path.dirname(script), [script, "--help"], io.StringIO()  # as `python script`
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        runpy.run_path(script, run_name="__main__")
    print(f"{script}\\t{out.getvalue().startswith('usage:')}\\t{out.getvalue().count(chr(10))}")
"""


@pytest.mark.distributed  # starts an interpreter
def test_every_benchmark_answers_help_without_running():
    """`python benchmarks/X.py --help` prints its usage and returns at once (cross_node_bytes.py used to run its
    69-second benchmark instead): every script, one after another in one interpreter."""
    out = subprocess.run([sys.executable, "-c", HELP_EACH, *map(str, BENCHMARK_SCRIPTS)], capture_output=True,
                         text=True, env=clean_env(), cwd=REPO, timeout=120)
    assert out.returncode == 0, output(out)
    answered = dict(line.split("\t")[:2] for line in out.stdout.splitlines())
    assert answered == {str(p): "True" for p in BENCHMARK_SCRIPTS}, output(out)
