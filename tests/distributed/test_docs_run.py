"""Every command line the README and docs/ show in a bash block runs as written, at a tiny size: in page order, in
one fresh working directory (as a newcomer's checkout: `examples/` and `benchmarks/` beside it, nothing prepared),
each checked for its exit code and one line of its output that says it did its job.

"At a tiny size" means: a `train` gets a tiny model of its kind and two iterations with one evaluation; a few
arguments that only set how much work is done are made smaller (SMALLER); a launch naming hosts that are not here
runs with --dry-run, and so does a `submit` (no scheduler here). A placeholder is a shell variable the page names (`$ERA5_DIR`: your ERA5
data), set here to the synthetic data. Lines that are not commands of meshtrain's (a job script's set-up, `make`,
whose recipes are the commands below them, the test suite itself) are listed in NOT_RUN with the reason, and
`make train`'s two commands run in its place. test_docs_links.py checks every line parses; this runs them.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests import preloaded
from tests.conftest import REPO, clean_env, forked_cmd, output
from tests.unit.test_docs_links import PAGES, command_lines, rel

pytestmark = pytest.mark.slow

# What a line starts with -> why it is not run here.
NOT_RUN = {
    "make test": "the suite itself (CI runs it)",
    "make test-fast": "the suite's unit tier (CI runs the whole suite)",
    "make lint": "ruff over the sources (CI's lint step)",
    ".venv/bin/python -m pytest": "the suite's distributed tier (CI runs the whole suite)",
    "cd $PBS_O_WORKDIR": "a PBS job script's set-up: the job's directory and environment",
    "source .venv/bin/activate": "a job script's set-up: the environment `make` built",
    "meshtrain train mypackage.tiny:SPEC": "run as written by test_own_model.py, beside the page's package",
    "torchrun --nproc-per-node 4 -m meshtrain train mypackage.tiny:SPEC": "run as written by test_own_model.py",
}
# `make train`, as its recipe runs it (Makefile), at the same tiny size as every train below.
MAKE_TRAIN = ["meshtrain prepare shakespeare_char", "meshtrain launch -- python -m meshtrain train gpt preset=cpu"]
TINY_MODEL = {
    "gpt": ["model.n_layer=4", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "model.batch_size=4"],
    "llama": ["model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=32", "model.block_size=32",
              "model.batch_size=2"],
    "moe": ["model.n_layer=2", "model.n_embd=32", "model.block_size=32", "model.batch_size=2", "model.expert_hidden=32"],
    "vit": ["model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=4", "data.crop=[32,64]",
            "data.batch_size=2", "data.global_batch_size=null", "data.limit_train=16"],
}
SHORT_RUN = {"train.max_iters": "2", "train.eval_interval": "2", "train.eval_iters": "1", "train.log_interval": "1"}
TEXT_RUN = {"train.sample_tokens": "4"}
# --validate on 2 ranks (2 ranks on 2 cores calibrate in half the time of 4: the same runs, collectives and regret), one
# layout once (--repeats: measuring each layout twice, interleaved, is tests/unit/test_regret.py's)
SMALLER = [(r"--gpus-per-node \d+(?=.*--validate)", "--gpus-per-node 2"), (r"--validate \d+", "--validate 1 --repeats 1"),
           (r"--max-bytes \S+", "--max-bytes 64K"),
           (r"num_data_workers=\d+", "num_data_workers=1"), (r"train.profile_start=\d+", "train.profile_start=0"),
           (r"train.profile_steps=\d+", "train.profile_steps=1"), (r"(examples/ddp_loop.py)", r"\1 --steps 20"),  # it logs every 20th step
           (r"(activation_checkpointing.py) --rounds \d+ --steps \d+", r"\1 --rounds 1 --steps 1"),
           (r"(activation_checkpointing.py .*model.batch_size=)\d+", r"\g<1>1")]  # the 6 × 384 GPT: one sample
NOT_HERE = re.compile(r"--rdzv-endpoint node\d")  # hosts of a cluster: the launcher command is built, not run
# No PBS or SLURM here: a submission is checked and its script (or interactive request) printed, not queued; queueing
# through the real sbatch is tests/distributed/test_slurm.py's.
NO_SCHEDULER = re.compile(r"^meshtrain submit (?!.*--dry-run)")
# Lines whose job is to find what is wrong: on this CPU box, a doctor asked for GPUs reports their absence, exit 1.
FINDS_AN_ERROR_HERE = re.compile(r"\bdoctor\b.*--gpus-per-node [1-9]")
# A line of the output that says the command did its job, by what the command is.
SAID = [(r"\bsubmit\b.*--interactive", r"^(qsub -I|salloc) "), (r"\bsubmit\b", r"^#(PBS|SBATCH) "),
        (r"\bdoctor\b.*--json", r'"name": "python"'), (r"\bdoctor\b", r"meshtrain doctor: \d+ ok"),
        (r"--dry-run", r"^(env (\S+=\S+ )+)?(\S*/)?(torchrun|mpiexec|srun|python\S*) "), (r"\btest-dist\b",
        r"test-dist passed: \d+ rank\(s\) on 1 node\(s\) hold bit-identical parameters"),
        (r"\btrain (gpt|vit|llama|moe)\b", r"done: \d+ iterations"), (r"prepare text --verify", r"every shard agrees"),
        (r"\bprepare\b", r"wrote data/|is up to date"),
        (r"\bsample\b", r"^What is an LLM\?"), (r"\bexport\b", r"^wrote \S+\.pt"), (r"\bmachine\b", r"matmul"),
        (r"\bplan\b.*--json", r'"layout":'), (r"\bplan\b.*--validate", r"regret"),
        (r"\bplan\b", r"train the first with: meshtrain train"), (r"\breport\b", r"report of \d+ run\(s\)"),
        (r"collectives --demo", r"collectives demo: 12/12 passed on \d+ ranks"),
        (r"collectives --bench", r"all_gather"),
        (r"ddp_loop.py", r"│ world_size\s+│ \d+\s"),  # and the report of its run, below it
        (r"activation_checkpointing.py", r"^\| op \| [\d.]+ \|")]


def documented_lines() -> list[tuple[str, str]]:
    """(page, line) of every bash-block line, in page order, each once; comments and PBS/SLURM directives out."""
    seen, found = set(), []
    for page in PAGES:
        for line in command_lines(page.read_text()):
            command = strip_comment(line)
            if command and command not in seen:
                seen.add(command)
                found.append((rel(page), command))
    return found


def strip_comment(line: str) -> str:
    """The line without its shell comment (a `#` that starts a word, outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip()
    return line.strip()


def as_run_here(line: str) -> list[str]:
    """The command lines that run for `line`, at a tiny size."""
    if line.startswith("make train"):
        return [tiny(command) for command in MAKE_TRAIN]
    return [tiny(line)]


def tiny(line: str) -> str:
    for pattern, replacement in SMALLER:
        line = re.sub(pattern, replacement, line)
    if NOT_HERE.search(line):
        line = line.replace("meshtrain launch ", "meshtrain launch --dry-run ", 1)
    if NO_SCHEDULER.search(line):
        line = line.replace("meshtrain submit ", "meshtrain submit --dry-run ", 1)
    for model in TINY_MODEL:
        if re.search(rf"\btrain {model}\b", line) and "--dry-run" not in line:
            extra = {**SHORT_RUN, **(TEXT_RUN if model != "vit" else {})}
            line += " " + " ".join([*TINY_MODEL[model], *(f"{k}={v}" for k, v in extra.items())])
    return line


LINES = documented_lines()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A fresh working directory beside a checkout's examples/ and benchmarks/, and the environment of a shell in
    it: the venv's commands first on PATH, the page's placeholders set."""
    root = tmp_path_factory.mktemp("newcomer")
    for folder in ("examples", "benchmarks"):
        (root / folder).symlink_to(REPO / folder)
    (root / "my_corpus.txt").write_text("To be, or not to be, that is the question.\n" * 400)  # $CORPUS
    folder = root / "my_corpus_dir"  # $CORPUS_DIR: documents in jsonl.gz and plain text
    folder.mkdir()
    with gzip.open(folder / "part0.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": f"Speech {i}. " + "Now is the winter of our discontent. " * 9}) + "\n"
                     for i in range(60))
    (folder / "sonnet.txt").write_text("Shall I compare thee to a summer's day?\n" * 20)
    return root


def shell_env(root: Path) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return clean_env(PATH=f"{bin_dir}:{os.environ.get('PATH', '')}", ERA5_DIR=str(root / "data" / "era5_synthetic"),
                     CORPUS=str(root / "my_corpus.txt"), CORPUS_DIR=str(root / "my_corpus_dir"),
                     OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                     OMPI_MCA_rmaps_base_oversubscribe="1",
                     MESHTRAIN_TIMEOUT="120",
                     # a newcomer's machine profile, empty until the lines that measure fill it (`machine`, `plan
                     # --validate`'s calibration), whatever the suite's other processes measured before
                     MESHTRAIN_CACHE_DIR=str(root / "home-cache"))


def said(line: str) -> str | None:
    return next((expected for pattern, expected in SAID if re.search(pattern, line)), None)


# A documented torchrun of a training run or a script, whose ranks the suite forks (tests/forked_ranks.py: torch's own
# elastic agent, rendezvous and environment, ranks forked from a process that imported torch). The launcher's own
# lines (`torchrun ... test-dist`, `meshtrain launch ... test-dist`) run the real torchrun, as test_runtime does.
FORKED_TORCHRUN = re.compile(r"^torchrun (?:--standalone )?--nproc-per-node (\d+) (?:--standalone )?(?!.*\btest-dist\b)")
# Any other `meshtrain launch` line: the command launch decides on (its --dry-run, the same code choosing the launcher,
# the ranks and the options), where that is a plain torchrun on this host, with its ranks forked as above (the real
# launch hands over to a real torchrun in test-dist's lines here and in test_train_gpt's and the multi-node tests).
LAUNCHED = re.compile(r"^meshtrain launch (?!--dry-run)(?!.*\btest-dist\b)")
DECIDED_TORCHRUN = re.compile(r"^\S*torchrun --standalone --nproc-per-node=(\d+) (--max-restarts=\d+ )?(.*)$")


def run_as_the_shell_would(command: str, workspace: Path) -> subprocess.CompletedProcess:
    """`command` as bash runs it. A `meshtrain ...` or `python SCRIPT ...` command, a torchrun of FORKED_TORCHRUN's or
    a `meshtrain launch` of LAUNCHED's (alone, or one of an `a && b` chain), its `$NAME`s expanded as bash would,
    runs the same entry point in a process forked from tests/preloaded.py's server (the console script is `python -m
    meshtrain`'s main; a fresh interpreter would spend ~1 s importing torch first, each of a torchrun's ranks too);
    anything else (another launcher, a pipe, a glob, quotes) runs under bash itself."""
    env = shell_env(workspace)
    parts = [re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), m.group(0)), part) for part in command.split(" && ")]
    argvs = [forked_argv(part, env, workspace) for part in parts]
    if None in argvs:
        return subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=workspace, env=env,
                              timeout=300)
    stdout = stderr = ""
    for argv in argvs:  # && : each only if the one before succeeded
        done = preloaded.run(argv, env=env, cwd=workspace, timeout=300)
        stdout, stderr = stdout + done.stdout, stderr + done.stderr
        if done.returncode != 0:
            break
    return subprocess.CompletedProcess(command, done.returncode, stdout, stderr)


def forked_argv(part: str, env: dict[str, str], workspace: Path) -> list[str] | None:
    """The forked process's `python ...` argv for one command of a line, or None where bash must run it."""
    # a list value (`data.crop=[32,64]`) is a glob to bash that matches no file here: bash passes it as it is
    if re.search(r"[$&|;<>`'\"\\*?\[~]", re.sub(r"=\[[\w,.]*\]", "=", part)):
        return None
    if LAUNCHED.match(part):
        return launched_argv(part, env, workspace)
    if part.startswith("meshtrain "):
        return [sys.executable, "-m", "meshtrain", *part.split()[1:]]
    if part.startswith("python ") and part.split()[1].endswith(".py"):
        return [sys.executable, *part.split()[1:]]
    if ranks := FORKED_TORCHRUN.match(part):
        return forked_cmd(int(ranks.group(1)), *part[ranks.end():].split())
    return None


def launched_argv(part: str, env: dict[str, str], workspace: Path) -> list[str] | None:
    """The torchrun that `meshtrain launch` decides on for `part`, as forked ranks; None where it decides on anything
    else (another launcher, an environment of its own for the ranks): bash runs the line as written."""
    dry = preloaded.run([sys.executable, "-m", "meshtrain", "launch", "--dry-run", *part.split()[2:]], env=env,
                        cwd=workspace, timeout=60)
    assert dry.returncode == 0, f"`{part}` with --dry-run exited {dry.returncode}:\n{output(dry)[-2000:]}"
    decided = DECIDED_TORCHRUN.match(dry.stdout.strip().splitlines()[-1])
    if not decided:
        return None
    ranks, restarts, args = decided.groups()
    return forked_cmd(int(ranks), *([restarts.strip()] if restarts else []), *args.split())


def crash(text: str) -> str:
    """A crashed rank's own report, which the tail of a long output cuts (faulthandler prints the aborting thread's
    stack first, then every other's and the extension modules), with the lines before it: where a C++ thread threw
    (gloo's transport, say), what it threw is printed there ("terminate called after throwing ... what(): ...")."""
    start = text.find("Fatal Python error")
    return f"{text[max(0, start - 1500):start + 3000]}\n[...]\n" if start >= 0 else ""


@pytest.mark.parametrize("page,line", LINES, ids=[f"{page}: {line[:60]}" for page, line in LINES])
def test_the_documented_command_runs_as_written(page, line, workspace):
    reason = next((why for start, why in NOT_RUN.items() if line.startswith(start)), None)
    if reason:
        pytest.skip(f"not run here: {reason}")
    if line.startswith("mpirun") and not shutil.which("mpirun"):
        pytest.skip("mpirun is not installed here (Open MPI: .ci/run installs it)")
    for command in as_run_here(line):
        expected = said(command)
        assert expected, f"{page}: no expected output is known for `{command}`: add one to SAID"
        done = run_as_the_shell_would(command, workspace)
        text = output(done)
        exit_code = 1 if FINDS_AN_ERROR_HERE.search(command) else 0
        assert done.returncode == exit_code, f"{page}: `{command}` exited {done.returncode}:\n{crash(text)}{text[-4000:]}"
        assert re.search(expected, text, re.MULTILINE), f"{page}: `{command}` did not say /{expected}/:\n{text[-3000:]}"
        # output that goes to a file carries no colour codes, under mpirun too (whose ranks get pseudo-terminals)
        assert "\x1b[" not in text, f"{page}: `{command}` wrote terminal escape codes to a file:\n{text[-2000:]}"
