"""Several nodes on one box: a network namespace per node, each with its own address and host name, joined by veth
links to a bridge in a "switch" namespace of their own, so that every byte between two nodes crosses a link whose
counters can be read.

    with Cluster(2) as cluster:
        job = cluster.start(0, ["torchrun", ...])      # runs inside node 0, host name cluster.host(0)
        cluster.sent(0)                               # bytes node 0 has put on its link so far

Needs root (CI runs as root) and the `ip` and `unshare` commands; `why_not()` says why a machine cannot. Names carry
this process's id, so that two test sessions on one machine keep apart. Host names resolve through
/etc/netns/<ns>/hosts, which `ip netns exec` mounts over /etc/hosts, as a cluster's DNS would.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

SUBNET = "10.77.0"


@functools.cache
def why_not() -> str | None:
    """None where namespaces can be made here, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "unshare", "pkill"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian: iproute2, util-linux, procps)"
    probe = f"mtprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Cluster:
    def __init__(self, nodes: int):
        tag = os.getpid() % 100000
        self.nodes, self.switch = nodes, f"mt{tag}sw"
        self.namespaces = [f"mt{tag}n{i}" for i in range(nodes)]
        self.links = [f"mt{tag}v{i}" for i in range(nodes)]  # the switch's end of each node's link
        self.jobs: list[subprocess.Popen] = []

    def host(self, node: int) -> str:
        return f"node{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{10 + node}"

    def __enter__(self) -> Cluster:
        try:
            self._ip("netns", "add", self.switch)
            self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.switch, "link", "set", "br0", "up")
            hosts = "127.0.0.1 localhost\n" + "".join(f"{self.address(i)} {self.host(i)}\n" for i in range(self.nodes))
            for i, (ns, link) in enumerate(zip(self.namespaces, self.links, strict=True)):
                self._ip("netns", "add", ns)
                self._ip("link", "add", link, "netns", self.switch, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._ip("-n", self.switch, "link", "set", link, "master", "br0")
                self._ip("-n", self.switch, "link", "set", link, "up")
                self._ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                self._ip("-n", ns, "link", "set", "eth0", "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for i in range(self.nodes):
            self.kill(i)
        for job in self.jobs:
            try:
                job.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for ns in [*self.namespaces, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    def start(self, node: int, argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
        """`argv` inside node `node`: its network, its host name; stdout and stderr together, as text."""
        wrapped = ["ip", "netns", "exec", self.namespaces[node], "unshare", "--uts", "sh", "-c",
                   f'hostname {self.host(node)} && exec "$@"', "sh", *argv]
        job = subprocess.Popen(wrapped, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                               start_new_session=True)
        self.jobs.append(job)
        return job

    def torchrun(self, node: int, job: str, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
        """`torchrun --nnodes N --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint node0:29400 -m meshtrain
        ARGS` on node `node`, as a job script runs it on each of its nodes (`job`: the rendezvous id)."""
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes), "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.host(0)}:29400", "--rdzv-id", job,
                "-m", "meshtrain", *args]
        return self.start(node, argv, env, cwd)

    def sent_at_steps(self, job: subprocess.Popen, steps: set[int]) -> tuple[str, dict[int, int]]:
        """Read the output of `job` (the one with rank 0) to its end; as rank 0 logs each iteration in `steps`, the
        bytes all nodes have sent so far. Returns (the output, {iteration: bytes})."""
        lines, sent = [], {}
        for line in job.stdout:
            lines.append(line)
            step = re.search(r"\] step=(\d+) ", line)
            if step and int(step.group(1)) in steps:
                sent[int(step.group(1))] = sum(self.sent(i) for i in range(self.nodes))
        job.wait()
        return "".join(lines), sent

    def remote_shell(self, path: Path) -> Path:
        """An `ssh` for mpirun's remote agent (`--mca plm_rsh_agent PATH`): `PATH HOST COMMAND` runs COMMAND in that
        host's node, with its host name, as ssh would on a cluster."""
        cases = "".join(f"  {self.host(i)}) ns={ns} ;;\n" for i, ns in enumerate(self.namespaces))
        path.write_text(f'#!/bin/sh\nhost=$1; shift\ncase $host in\n{cases}  *) echo "no node $host" >&2; exit 255 ;;\n'
                        'esac\nexec ip netns exec "$ns" unshare --uts sh -c "hostname $host && exec sh -c \\"\\$0\\"" "$*"\n')
        path.chmod(0o755)
        return path

    def lose(self, node: int) -> None:
        """Node `node` fails for good: its processes die at once and it answers nothing any more (its namespace is
        gone, so the remote shell cannot reach it either)."""
        self.kill(node)
        subprocess.run(["ip", "netns", "del", self.namespaces[node]], capture_output=True)

    def kill(self, node: int) -> None:
        """Every process of node `node` dies at once (SIGKILL), as when a node fails."""
        pids = subprocess.run(["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def sent(self, node: int) -> int:
        """Bytes node `node` has sent to the others (what the switch received on its link)."""
        out = subprocess.run(["ip", "-n", self.switch, "-s", "-j", "link", "show", self.links[node]],
                             capture_output=True, text=True, check=True).stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def _ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
