"""`meshtrain submit`: the PBS and SLURM scripts it writes, each directive against the scheduler's syntax, the input it
refuses (with its message) before anything is queued, the planner's memory check on a shipped system, and queueing
through fake qsub and sbatch programs on PATH that record their calls."""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from meshtrain.commands import parse
from meshtrain.commands import submit as submit_command
from meshtrain.config import ConfigError
from meshtrain.errors import DataError, MeshtrainError
from meshtrain.plan import systems
from meshtrain.runtime import jobscript
from meshtrain.runtime.jobscript import SubmitError

TRAIN = ["meshtrain", "train", "gpt", "preset=gpt2", "data=tiny"]
# GPT-2 XL's parameter count (1.48B with tiny's 65-token vocabulary) in 12 wide blocks, which the planner costs 4×
# faster than 48, in fp32 with 8 samples of 1024 tokens per rank: plain DDP holds weights, gradients and AdamW's two
# moments, 4 × 5.9 GB, and the activations
GPT2_XL_FP32 = [*TRAIN, "model.n_layer=12", "model.n_embd=3200", "model.n_head=25", "model.batch_size=8",
                "train.dtype=fp32"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A submit directory with a prepared 65-character dataset `tiny`, no site file, and a bin/ of fake qsub and
    sbatch (each records its arguments in calls.log and prints what the real one prints) that is all of PATH."""
    data = tmp_path / "data" / "tiny"
    data.mkdir(parents=True)
    tokens = np.arange(4096, dtype="<u2") % 65
    tokens.tofile(data / "train.bin")
    tokens[:2048].tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps({"tokenizer": "char", "vocab_size": 65, "train_tokens": 4096,
                                                "val_tokens": 2048}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, says in (("qsub", "4242.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov"), ("sbatch", "Submitted batch job 4242")):
        fake = bin_dir / name
        fake.write_text(f'#!/bin/sh\necho "{name} $*" >> {tmp_path}/calls.log\necho "{says}"\n')
        fake.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


def submit(*argv: str) -> int:
    return submit_command.run(parse(["submit", *argv]))


def directives(text: str, prefix: str) -> list[str]:
    return [line[len(prefix) + 1:] for line in text.splitlines() if line.startswith(prefix + " ")]


def calls(workdir: Path) -> list[str]:
    log = workdir / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


# ------------------------------------------------------------------------------------------------ scripts
def test_pbs_script_for_polaris_holds_its_resource_lines(workdir, capsys):
    assert submit("--system", "polaris", "--nodes", "2", "--time", "00:30:00", "--queue", "debug", "--account",
                  "myproj", "--dry-run", "--", *TRAIN) == 0
    script = capsys.readouterr().out
    assert directives(script, "#PBS") == ["-N meshtrain-gpt", "-l select=2:ncpus=64:ngpus=4", "-l walltime=00:30:00",
                                          "-l filesystems=home:eagle", "-q debug", "-A myproj", "-j oe"]
    body = script.split("\n\n", 1)[1].splitlines()
    assert body[0] == f"cd {workdir}"
    assert body[2] == "meshtrain launch -- meshtrain train gpt preset=gpt2 data=tiny train.init_from=auto"
    assert "# checked: the config of `meshtrain train gpt` loads" in script
    assert f"# checked: the data is prepared in {workdir}/data/tiny" in script
    assert "# PBS sends no warning before the walltime, only its SIGTERM: the run then saves and exits 75.\n" in script
    assert calls(workdir) == []


def test_slurm_script_for_perlmutter_asks_for_gpus_and_requeues_a_preempted_run(workdir, capsys):
    assert submit("--system", "perlmutter", "--nodes", "4", "--account", "m1234", "--dry-run", "--", *TRAIN) == 0
    script = capsys.readouterr().out
    assert directives(script, "#SBATCH") == [
        "--job-name=meshtrain-gpt", "--nodes=4", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=32",
        "--time=01:00:00", "--qos=regular", "--account=m1234", "--constraint=gpu",
        f"--output={workdir}/meshtrain-gpt-%j.out", "--open-mode=append", "--signal=USR1@120", "--requeue"]
    assert 'if [ "$status" -eq 75 ]; then scontrol requeue "$SLURM_JOB_ID"; fi' in script.splitlines()
    assert "trap : USR1  # the ranks get SLURM's USR1 from their own step" in script.splitlines()
    assert script.endswith('exit "$status"\n')


def test_frontier_queues_by_partition_and_perlmutter_80_by_its_constraint(workdir, capsys):
    submit("--system", "frontier", "--nodes", "2", "--dry-run", "--", "python", "-m", "meshtrain", "test-dist")
    frontier = directives(capsys.readouterr().out, "#SBATCH")
    assert "--partition=batch" in frontier and "--gpus-per-node=8" in frontier and "--cpus-per-task=7" in frontier
    submit("--system", "perlmutter-80", "--nodes", "1", "--dry-run", "--", *TRAIN)
    assert "--constraint=gpu&hbm80g" in directives(capsys.readouterr().out, "#SBATCH")


# qsub's documented forms (PBS Professional Reference Guide, qsub): -N name, -l select=N[:res=value...],
# -l walltime=[[HH:]MM:]SS, -l filesystems=a:b (ALCF), -q queue, -A account, -j oe|eo|n, -o/-e path
PBS_SYNTAX = {
    "-N": r"[A-Za-z][\w.-]{0,235}",
    "-l": r"select=\d+(:(ncpus|ngpus|mpiprocs)=\d+)*|walltime=\d+:[0-5]\d:[0-5]\d|filesystems=\w+(:\w+)*",
    "-q": r"[\w-]+", "-A": r"[\w-]+", "-j": r"oe|eo|n", "-o": r"\S+", "-e": r"\S+",
}


@pytest.mark.parametrize("system", ["polaris", "aurora", None])
def test_every_pbs_directive_is_one_qsub_documents(workdir, capsys, system):
    where = ["--system", system] if system else ["--scheduler", "pbs", "--gpus-per-node", "2"]
    submit(*where, "--nodes", "3", "--account", "p", "--time", "12:00:00", "--dry-run", "--", *TRAIN)
    found = directives(capsys.readouterr().out, "#PBS")
    assert len(found) >= 5
    for directive in found:
        flag, value = directive.split(" ", 1)
        assert flag in PBS_SYNTAX and re.fullmatch(PBS_SYNTAX[flag], value), directive


def test_a_cpu_pbs_job_writes_its_ranks_per_node_into_the_nodefile(workdir, capsys):
    submit("--scheduler", "pbs", "--nodes", "2", "--ranks-per-node", "4", "--dry-run", "--", *TRAIN)
    assert directives(capsys.readouterr().out, "#PBS")[1:3] == ["-l select=2:mpiprocs=4", "-l walltime=01:00:00"]


def test_the_environment_that_ran_submit_is_activated_or_the_script_says_there_is_none(workdir, capsys, monkeypatch):
    venv = workdir / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    monkeypatch.setattr(sys, "prefix", str(venv))
    submit("--scheduler", "slurm", "--nodes", "1", "--dry-run", "--", "python", "-m", "meshtrain", "test-dist")
    assert f"source {venv}/bin/activate  # the environment that ran `meshtrain submit`" in capsys.readouterr().out
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    submit("--scheduler", "slurm", "--nodes", "1", "--dry-run", "--", "python", "-m", "meshtrain", "test-dist")
    script = capsys.readouterr().out
    assert "# no virtual environment ran `meshtrain submit`" in script
    assert f"{sys.executable} -m meshtrain launch -- python -m meshtrain test-dist\n" in script


def test_a_train_command_resumes_unless_it_names_its_own_init_from(workdir, capsys):
    submit("--scheduler", "slurm", "--nodes", "1", "--dry-run", "--", *TRAIN, "train.init_from=scratch")
    assert "data=tiny train.init_from=scratch\n" in capsys.readouterr().out
    submit("--scheduler", "slurm", "--nodes", "1", "--dry-run", "--", "python", "-m", "meshtrain", "train", "gpt",
           "preset=gpt2", "data=tiny")
    assert "-- python -m meshtrain train gpt preset=gpt2 data=tiny train.init_from=auto\n" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ refused
@pytest.mark.parametrize("argv, message", [
    (["--system", "polaris", "--nodes", "561"], "--nodes 561: polaris has 560 nodes"),
    (["--scheduler", "pbs", "--nodes", "0"], "--nodes 0: give 1 or more"),
    (["--system", "polaris", "--nodes", "1", "--time", "90m"], "--time '90m': give the walltime as HH:MM:SS"),
    (["--system", "polaris", "--nodes", "1", "--time", "01:75:00"], "--time '01:75:00': give the walltime as HH:MM:SS"),
    (["--system", "summit", "--nodes", "1"], "unknown system 'summit': the known systems are polaris, perlmutter"),
    (["--scheduler", "lsf", "--nodes", "1"], "unknown scheduler 'lsf': choose pbs or slurm"),
    (["--system", "polaris", "--nodes", "1", "--queue", "regular"],
     "--queue regular: polaris's queue names are debug, debug-scaling, prod, preemptable, demand"),
    (["--system", "perlmutter", "--nodes", "1", "--queue", "prod"],
     "--queue prod: perlmutter's qos names are regular, debug"),
    (["--system", "polaris", "--scheduler", "slurm", "--nodes", "1"], "--scheduler slurm: polaris runs PBS"),
    (["--system", "polaris", "--nodes", "1", "--gpus-per-node", "8"], "--gpus-per-node 8: a polaris node has 4"),
    (["--scheduler", "slurm", "--nodes", "1", "--ranks-per-node", "0"],
     "--gpus-per-node 0 --ranks-per-node 0: give 0 or more GPUs and 1 or more ranks"),
    (["--system", "polaris", "--nodes", "1", "--name", "my job"],
     "--name 'my job': a job name is a letter, then up to 14 letters"),
])
def test_bad_input_is_refused_with_one_clear_error_and_nothing_queued(workdir, argv, message):
    with pytest.raises(MeshtrainError) as error:
        submit(*argv, "--", *TRAIN)
    assert str(error.value).startswith(message), str(error.value)
    assert calls(workdir) == [] and not (workdir / ".meshtrain").exists()


@pytest.mark.parametrize("launch", [["meshtrain", "launch"], ["python", "-m", "meshtrain", "launch"]])
def test_a_command_that_launches_itself_is_refused(workdir, launch):
    with pytest.raises(SubmitError, match=r"the job script runs `meshtrain launch` itself; give what follows launch's"):
        submit("--system", "polaris", "--nodes", "1", "--", *launch, "--", *TRAIN)


def test_no_scheduler_on_path_and_none_named_is_refused(workdir, monkeypatch):
    monkeypatch.setenv("PATH", str(workdir / "nowhere"))
    with pytest.raises(SubmitError, match=r"^no scheduler found: neither qsub \(PBS\) nor sbatch \(SLURM\) is on PATH"):
        submit("--nodes", "1", "--", *TRAIN)


def test_the_scheduler_on_path_is_used_when_none_is_named(workdir, capsys):
    (workdir / "bin" / "sbatch").unlink()
    submit("--nodes", "1", "--dry-run", "--", *TRAIN)
    assert directives(capsys.readouterr().out, "#PBS")[:2] == ["-N meshtrain-gpt", "-l select=1:mpiprocs=1"]


def test_unprepared_data_and_a_bad_config_are_refused_before_queueing(workdir):
    with pytest.raises(DataError, match=r"data/shakespeare not found: this dataset has not been prepared\. Run "
                                        r"`meshtrain prepare shakespeare`"):
        submit("--system", "polaris", "--nodes", "1", "--", *TRAIN[:-1])
    with pytest.raises(ConfigError, match="model.n_layers"):
        submit("--system", "polaris", "--nodes", "1", "--", *TRAIN, "model.n_layers=4")
    assert calls(workdir) == []


def test_site_file_gives_defaults_and_refuses_unknown_keys(workdir, capsys):
    site = workdir / "config" / "meshtrain" / "submit.yaml"
    site.parent.mkdir(parents=True)
    site.write_text("system: polaris\naccount: myproj\nqueue: debug\ntime: 00:30:00\n")  # YAML 1.1: 1800 seconds
    submit("--nodes", "1", "--dry-run", "--", *TRAIN)
    found = directives(capsys.readouterr().out, "#PBS")
    assert "-A myproj" in found and "-q debug" in found and "-l walltime=00:30:00" in found
    site.write_text("system: polaris\nprojetc: myproj\n")
    with pytest.raises(SubmitError, match=r"submit.yaml: unknown key\(s\) projetc: a site file sets system, scheduler"):
        submit("--nodes", "1", "--dry-run", "--", *TRAIN)


# ------------------------------------------------------------------------------------------------ memory
def test_a_layout_that_cannot_fit_is_refused_with_the_prediction_and_one_that_fits(workdir, capsys):
    with pytest.raises(ConfigError) as error:
        submit("--system", "polaris", "--nodes", "1", "--", *GPT2_XL_FP32)
    message = str(error.value)
    said = re.match(r"out of memory ahead: ddp dp4 ac=none needs about ([\d.]+) GiB per rank at its peak "
                    r"\(`meshtrain plan`'s prediction, fp32\), but 90% of a polaris device's 40 GiB gives 36.00 GiB",
                    message)
    assert said and 46.5 < float(said[1]) < 47.5, message  # 46.89 GiB when written
    assert "; these fit: model.batch_size=2 train.grad_accum=160; " in message and "; train.backend=fsdp;" in message
    first = re.search(r"on 1 node\(s\) × 4 polaris, `meshtrain plan` ranks first fsdp dp4 ac=none \(([\d.]+) GiB\): "
                      r"train.backend=fsdp ", message)
    assert first and 29 < float(first[1]) < 31, message  # 29.92 GiB: the weights' states sharded 4 ways
    assert message.endswith("; nothing submitted") and calls(workdir) == []
    assert submit("--system", "perlmutter-80", "--nodes", "1", "--dry-run", "--", *GPT2_XL_FP32) == 0
    fits = re.search(r"# checked: it fits on 1 node\(s\) × 4 perlmutter-80: ddp dp4 ac=none needs about ([\d.]+) GiB per "
                     r"rank at its peak \(`meshtrain plan`'s prediction, fp32\); 90% of a perlmutter-80 device's 80 GiB "
                     r"gives 72.00 GiB\n", capsys.readouterr().out)
    assert fits and fits[1] == said[1]  # the same prediction, against twice the memory


def test_plan_auto_writes_the_planners_pick_into_the_script(workdir, capsys):
    submit("--system", "polaris", "--nodes", "1", "--dry-run", "--", *GPT2_XL_FP32, "parallel.plan=auto")
    script = capsys.readouterr().out
    pick = re.search(r"# parallel.plan=auto: the planner's pick on 1 node\(s\) × 4 polaris: (.+), predicted "
                     r"([\d.]+) GiB peak per rank, [\d.]+ ms per step\n#   \(train.backend=", script)
    assert pick and "dp4" in pick[1] and float(pick[2]) < 36, script


# ------------------------------------------------------------------------------------------------ queueing
def test_dry_run_queues_nothing_and_writes_nothing(workdir, capsys):
    assert submit("--scheduler", "slurm", "--nodes", "2", "--dry-run", "--", *TRAIN) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n")
    assert calls(workdir) == [] and not (workdir / ".meshtrain").exists()


def test_submit_queues_the_script_with_sbatch_and_prints_the_job_id_and_log(workdir, capsys):
    assert submit("--scheduler", "slurm", "--nodes", "2", "--", *TRAIN) == 0
    out = capsys.readouterr().out.splitlines()
    script = next((workdir / ".meshtrain" / "jobs").glob("meshtrain-gpt-*.sh"))
    assert calls(workdir) == [f"sbatch {script}"]
    assert out == [f"queued job 4242 (slurm): script {script}", f"log: {workdir}/meshtrain-gpt-4242.out"]
    assert "#SBATCH --nodes=2" in script.read_text()


def test_submit_queues_the_script_with_qsub_and_prints_the_job_id_and_log(workdir, capsys):
    assert submit("--system", "polaris", "--nodes", "1", "--account", "p", "--", *TRAIN) == 0
    out = capsys.readouterr().out.splitlines()
    script = next((workdir / ".meshtrain" / "jobs").glob("meshtrain-gpt-*.sh"))
    assert calls(workdir) == [f"qsub {script}"]
    assert out == [f"queued job 4242.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov (pbs): script {script}",
                   f"log: {workdir}/meshtrain-gpt.o4242"]


def test_a_failed_qsub_is_one_error_with_what_it_said(workdir):
    (workdir / "bin" / "qsub").write_text("#!/bin/sh\necho 'qsub: Unknown queue' >&2\nexit 170\n")
    with pytest.raises(SubmitError, match=r"qsub .*\.sh failed \(exit 170\): qsub: Unknown queue$"):
        submit("--system", "polaris", "--nodes", "1", "--", *TRAIN)


@pytest.mark.parametrize("system, request_line", [
    ("polaris", "qsub -I -l select=2:ncpus=64:ngpus=4 -l walltime=00:20:00 -l filesystems=home:eagle -q debug -A p"),
    ("perlmutter", "salloc --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=32 --time=00:20:00 "
                   "--qos=debug --account=p --constraint=gpu"),
])
def test_interactive_prints_the_schedulers_request(workdir, capsys, system, request_line):
    assert submit("--system", system, "--nodes", "2", "--time", "00:20:00", "--queue", "debug", "--account", "p",
                  "--interactive", "--dry-run") == 0
    assert capsys.readouterr().out == request_line + "\n" and calls(workdir) == []


def test_job_ids_as_each_scheduler_prints_them():
    assert jobscript.job_id("slurm", "Submitted batch job 77\n") == "77"
    assert jobscript.job_id("pbs", "123.aurora-pbs-0001\n") == "123.aurora-pbs-0001"
    with pytest.raises(SubmitError, match="sbatch printed no job id: 'sbatch: error: Batch job submission failed'"):
        jobscript.job_id("slurm", "sbatch: error: Batch job submission failed")


def test_every_shipped_scheduler_entry_fits_its_system():
    for name in systems.names():
        facts = systems.get(name).scheduler
        if facts is not None:
            assert facts.kind in jobscript.SCHEDULERS and facts.default_queue in facts.queues and facts.nodes > 0
            assert facts.cpus_per_node >= systems.get(name).devices_per_node
