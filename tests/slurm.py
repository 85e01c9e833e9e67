"""A real SLURM on the nodes of tests/netns.py: a munged of its own, slurmctld on node 0 (the head node) and a slurmd
on each node, under that node's host name, all reading one slurm.conf in a temporary directory.

    with Cluster(2) as cluster, Slurm(cluster) as slurm:
        job = cluster.start(0, ["salloc", "--nodes=2", ...], slurm.env(), cwd)   # a job submitted from node 0

Needs root, namespaces (tests/netns.py) and Debian's slurmctld, slurmd, slurm-client and munge; `why_not()` says
why a machine cannot. Nothing here touches /etc/slurm, /etc/munge or the system's daemons: every path (key, socket,
spool, state, logs, pid files) lies in the temporary directory, named with this process's id as netns.py names its
namespaces, so that two test sessions on one machine keep apart. Clients find it all through SLURM_CONF.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.conftest import clean_env
from tests.netns import Cluster
from tests.netns import why_not as no_namespaces

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "salloc", "sinfo")
# How long slurmctld waits for a silent slurmd before it marks the node DOWN (SLURM's default is 300 s), and for any
# one message (10 s): slurmctld pings a lost node again only once its last ping has timed out, so a lost node is DOWN
# some 15 s after it died here (30 s with the default MessageTimeout). A job run with --no-kill then goes on
# without it: srun's step ends, and new steps avoid it.
SLURMD_TIMEOUT_S = 5
MESSAGE_TIMEOUT_S = 5
# Each node offers 2 CPUs, one for each of the 2 tasks per node the tests ask for: slurmd drains a node that claims
# more CPUs than the machine has, and accepts fewer (all nodes share this machine's cores).
CPUS_PER_NODE = 2
# How long a job credential lives (AuthInfo's cred_expire, 120 s by default), which is also how long SLURM holds a
# requeued job PENDING (Reason=BeginTime, eligible cred_expire + 1 s after its requeue): the slurmds revoked the
# job's credentials when it was requeued and refuse any of them issued before the revocation expires. A job forced
# to start sooner (`scontrol update starttime=now`) is killed at once, "Job credential revoked" (FAILED, ExitCode
# 1:0). A step's credential is used within a second here.
CRED_EXPIRE_S = 10
# A requeued job whose begin time has passed starts at the scheduler's next pass over the queue, not at once: every
# 60 s (the main loop's sched_interval) or 30 s (backfill's bf_interval) by default; here every 2 s.
SCHED_INTERVAL_S = 2


@functools.cache
def why_not() -> str | None:
    """None where a SLURM can be brought up on namespace nodes here, else the reason."""
    if (reason := no_namespaces()) is not None:
        return reason
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (Debian: slurmctld slurmd slurm-client munge; .ci/run installs them)"
    return None


class Slurm:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.dir = Path(tempfile.mkdtemp(prefix=f"mtslurm{os.getpid() % 100000}-"))
        self.conf = self.dir / "slurm.conf"
        self.socket = self.dir / "munge" / "munge.socket"

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment whose SLURM commands talk to this SLURM."""
        return clean_env(SLURM_CONF=str(self.conf), **extra)

    def __enter__(self) -> Slurm:
        try:
            self._start_munge()
            self.conf.write_text(self._slurm_conf())
            # `ip netns exec` mounts a sysfs of the node's own, without /sys/fs/cgroup's mounts, where slurmd's
            # default (autodetect) finds no cgroup version and gives up; cgroup/v1 starts without a mount, and
            # no plugin here uses one (proctrack/linuxproc, task/none).
            (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
            # Each daemon forks into the background (so no pipe of ours fills with its log) and stays in the node's
            # namespace, under its host name, which is how slurmd knows which node of slurm.conf it is.
            self._run(0, "slurmctld", "-f", str(self.conf))
            for node in range(self.cluster.nodes):
                (self.dir / self.cluster.host(node) / "spool").mkdir(parents=True)
                self._run(node, "slurmd", "-f", str(self.conf))
            self._wait_until_idle(timeout=60)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for pid_file in self.dir.glob("**/*.pid"):  # munged, slurmctld and each slurmd (a lost node's is dead)
            try:
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
            except (ProcessLookupError, ValueError, IndexError):
                pass
        for node in range(self.cluster.nodes):  # the job steps' slurmstepd, which outlive a killed slurmd
            self.cluster.kill(node)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _start_munge(self) -> None:
        """munged with a key of its own: SLURM signs every message with it (auth/munge), and each node's daemons
        check it through the socket named in AuthInfo. One munged serves every node, as one key would."""
        home = self.dir / "munge"
        home.mkdir()
        for path in (self.dir, home):  # munged wants its socket reachable by every user, its key by none
            path.chmod(0o755)
        key = home / "munge.key"
        self._check(["mungekey", "--create", f"--keyfile={key}"])
        self._check(["munged", f"--socket={self.socket}", f"--key-file={key}", f"--pid-file={home / 'munged.pid'}",
                     f"--seed-file={home / 'munged.seed'}", f"--log-file={home / 'munged.log'}"])

    def _slurm_conf(self) -> str:
        """The smallest slurm.conf of a real cluster: no cgroups (linuxproc tracks the steps' processes by their
        parents), no accounting, no binding; a node silent for SLURMD_TIMEOUT_S is DOWN, and one that comes back
        with a working slurmd serves again (ReturnToService=2). One slurmd per node, each on its own address."""
        hosts = [self.cluster.host(i) for i in range(self.cluster.nodes)]
        nodes = "".join(f"NodeName={host} NodeAddr={self.cluster.address(i)} CPUs={CPUS_PER_NODE} State=UNKNOWN\n"
                        for i, host in enumerate(hosts))
        d = self.dir
        return f"""ClusterName=mt{os.getpid() % 100000}
SlurmctldHost={hosts[0]}({self.cluster.address(0)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={d}/slurmctld
SlurmctldPidFile={d}/slurmctld.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdSpoolDir={d}/%n/spool
SlurmdPidFile={d}/%n/slurmd.pid
SlurmdLogFile={d}/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdTimeout={SLURMD_TIMEOUT_S}
MessageTimeout={MESSAGE_TIMEOUT_S}
ReturnToService=2
SchedulerParameters=sched_interval={SCHED_INTERVAL_S},bf_interval={SCHED_INTERVAL_S}
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _run(self, node: int, *argv: str) -> None:
        """`argv` (a daemon that forks into the background) started inside node `node`; its parent must exit 0."""
        job = self.cluster.start(node, list(argv), self.env(), self.dir)
        out = job.communicate(timeout=60)[0]
        if job.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} on {self.cluster.host(node)} exited {job.returncode}: {out}\n"
                               + self.logs())

    def _wait_until_idle(self, timeout: float) -> None:
        """Until slurmctld reports every node idle (each slurmd has registered), or RuntimeError with its logs."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.sinfo()
            if states and all(state == "idle" for state in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM's nodes are not idle after {timeout:.0f} s: {states}\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        """The end of each daemon's log, for a failure to show."""
        return "".join(f"--- {log}\n{log.read_text()[-2000:]}" for log in sorted(self.dir.glob("**/*.log")))

    def sinfo(self) -> dict[str, str]:
        """{node: state} as slurmctld reports it, asked from node 0 (empty while slurmctld does not answer)."""
        job = self.cluster.start(0, ["sinfo", "--noheader", "--Node", "--format=%N %t"], self.env(), self.dir)
        out = job.communicate(timeout=30)[0]
        lines = [line.split() for line in out.splitlines()] if job.returncode == 0 else []
        return {words[0]: words[1] for words in lines if len(words) == 2}

    def _check(self, argv: list[str]) -> None:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
