"""The network as the ranks meet it: does the rendezvous address resolve, can its port be bound, and which interface
gloo and NCCL would send over (`meshtrain doctor` reports them; runtime/doctor.py holds the other checks).

gloo binds the interface that carries the address this host's name resolves to (GLOO_SOCKET_IFNAME overrides it), and
falls back to loopback, with a warning, where the name resolves to nothing local: other nodes then cannot reach it.
NCCL takes the interfaces NCCL_SOCKET_IFNAME names, else an InfiniBand (ib*) one, else any but lo and docker*.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Mapping

from meshtrain.runtime.doctor import ERROR, OK, WARNING, Check
from meshtrain.runtime.env import LaunchEnv, rendezvous, scheduler_info

SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address


def interface_names() -> list[str]:
    """This host's network interfaces, in the kernel's order."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def interface_addresses() -> dict[str, str]:
    """Each interface's IPv4 address; interfaces without one (or off Linux, every interface) are left out."""
    try:
        import fcntl
        import struct
    except ImportError:
        return {}
    addresses = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in interface_names():
            try:
                packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # up without an IPv4 address, or down
                continue
            addresses[name] = socket.inet_ntoa(packed[20:24])
    return addresses


def resolve(host: str) -> str | None:
    """`host`'s IPv4 address, None where it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def carrying(address: str, addresses: Mapping[str, str]) -> str | None:
    """The interface that holds `address` (127.x is always loopback's, whatever its name)."""
    for name, held in addresses.items():
        if held == address:
            return name
    return "lo" if address.startswith("127.") else None


def port_taken(port: int) -> str | None:
    """Why `port` cannot be bound on every interface, as the rendezvous store binds it; None when it can. The store
    sets SO_REUSEADDR too, so a port left in TIME_WAIT by a finished job is no obstacle to either."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as e:
            return "in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
    return None


def rendezvous_checks(launch: LaunchEnv, environ: Mapping[str, str], addresses: Mapping[str, str] | None = None,
                      mpi4py: bool = False, multi_node: bool = False) -> list[Check]:
    """The rendezvous address (resolves? reachable from other nodes?) and port (can rank 0 bind it here?), by the
    rule setup.py follows."""
    meeting = _where_a_launch_would_meet(launch, environ) or rendezvous(launch, environ)
    if meeting is None and mpi4py:
        return [Check("rendezvous", OK, "no address every rank can compute alike: rank 0 broadcasts its own over MPI "
                                        "(mpi4py)")]
    if meeting is None:
        return [Check("rendezvous", WARNING, "no address every rank can compute alike (several ranks, no job id or "
                      "host list): the ranks agree on one over MPI (mpi4py), or fail",
                      "export MASTER_ADDR (rank 0's host) and MASTER_PORT, or install mpi4py")]
    host, port, source = meeting
    address = resolve(host)
    if address is None:
        return [Check("rendezvous address", ERROR, f"{host} ({source}) does not resolve from this host",
                      "set MASTER_ADDR to a name or IP address of rank 0's node that every node resolves")]
    if multi_node and address.startswith("127."):
        return [Check("rendezvous address", ERROR, f"{host} -> {address} ({source}): loopback, which each node "
                      "resolves to itself", "set MASTER_ADDR to rank 0's node by a name the other nodes resolve, or "
                      "map this host's name to its network address in /etc/hosts")]
    checks = [Check("rendezvous address", OK, f"{host} -> {address} ({source})")]
    return checks + [_port_check(host, address, port, launch, environ, addresses)]


def _where_a_launch_would_meet(launch: LaunchEnv, environ: Mapping[str, str]) -> tuple[str, int | None, str] | None:
    """In the script of a job over several nodes, before any launcher: where the ranks it will start meet, by
    env.rendezvous's rule for them (MASTER_ADDR, else the job's first host). Without MASTER_PORT the port is None:
    each launch derives it from its own step's id, unknown until then."""
    hosts = scheduler_info(environ)[2]
    if launch.launcher != "none" or len(hosts) < 2:
        return None
    if launch.master_addr:
        return launch.master_addr, launch.master_port, "MASTER_ADDR, for the ranks a launch starts"
    return hosts[0], launch.master_port, f"the {launch.scheduler} job's first host, where its launched ranks meet"


def _port_check(host: str, address: str, port: int | None, launch: LaunchEnv, environ: Mapping[str, str],
                addresses: Mapping[str, str] | None) -> Check:
    if port is None:
        return Check("rendezvous port", OK, f"{host}: each launch derives its port from its job step's id")
    where = f"{host}:{port}"
    if launch.rank != 0:
        return Check("rendezvous port", OK, f"{where}: rank 0 binds it, this is rank {launch.rank}")
    if carrying(address, interface_addresses() if addresses is None else addresses) is None:
        return Check("rendezvous port", OK, f"{where}: not on this host; rank 0 binds it on {host}")
    why = port_taken(port)
    if why is None:
        return Check("rendezvous port", OK, f"{where}: free to bind")
    # torchrun's agent holds the port with the store its ranks then share: taken is how it should be.
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return Check("rendezvous port", OK, f"{where}: {why}, by torchrun's store (TORCHELASTIC_USE_AGENT_STORE)")
    return Check("rendezvous port", ERROR, f"{where}: {why}: rank 0's store cannot bind it",
                 "set MASTER_PORT to a free port (another job on this node holds this one), or end what holds it")


def gloo_interface_check(environ: Mapping[str, str], multi_node: bool, names: list[str] | None = None,
                         addresses: Mapping[str, str] | None = None,
                         hostname: Callable[[], str] = socket.gethostname) -> Check:
    """The interface gloo would bind: GLOO_SOCKET_IFNAME's (each must exist), else the one carrying this host's name."""
    names = interface_names() if names is None else names
    addresses = interface_addresses() if addresses is None else addresses
    chosen = environ.get("GLOO_SOCKET_IFNAME", "")
    if chosen:
        missing = [name for name in chosen.split(",") if name not in names]
        if missing:
            return Check("network (gloo)", ERROR, f"GLOO_SOCKET_IFNAME={chosen} names {', '.join(missing)}, which "
                         f"this host does not have (it has {', '.join(names) or 'none'})",
                         "set GLOO_SOCKET_IFNAME to one of this host's interfaces, or unset it")
        found = f"GLOO_SOCKET_IFNAME={chosen}: " + ", ".join(
            f"{name} ({addresses.get(name, 'no IPv4')})" for name in chosen.split(","))
        if multi_node and all(addresses.get(name, "").startswith("127.") for name in chosen.split(",")):
            return Check("network (gloo)", ERROR, found + ": loopback, which the other nodes cannot reach",
                         "set GLOO_SOCKET_IFNAME to the interface between the nodes")
        return Check("network (gloo)", OK, found)
    name = hostname()
    address = resolve(name)
    interface = carrying(address, addresses) if address else None
    if interface and interface != "lo":
        return Check("network (gloo)", OK, f"{interface} ({address}): the address this host's name {name} resolves to")
    found = (f"this host's name {name} resolves to {address or 'nothing'}" + (" on no interface here" if address and
             not interface else "") + ": gloo falls back to loopback")
    routable = [n for n in names if n in addresses and n != "lo" and not addresses[n].startswith("127.")]
    fix = f"export GLOO_SOCKET_IFNAME={routable[0] if routable else 'IFACE'} (an interface the other nodes reach)"
    if multi_node:
        return Check("network (gloo)", ERROR, found + ", which the other nodes cannot reach", fix)
    return Check("network (gloo)", OK, found + " (enough on one node)", "")


def nccl_interface_check(environ: Mapping[str, str], nccl_in_use: bool, names: list[str] | None = None) -> Check:
    """NCCL_SOCKET_IFNAME's interfaces (prefixes; `^` excludes, `=` means exactly), else NCCL's own choice."""
    names = interface_names() if names is None else names
    chosen = environ.get("NCCL_SOCKET_IFNAME", "")
    if chosen:
        missing = _unmatched_nccl_names(chosen, names)
        if missing:
            return Check("network (nccl)", ERROR, f"NCCL_SOCKET_IFNAME={chosen}: no interface here matches "
                         f"{', '.join(missing)} (this host has {', '.join(names) or 'none'})",
                         "set NCCL_SOCKET_IFNAME to a prefix of one of this host's interfaces, or unset it")
        return Check("network (nccl)", OK, f"NCCL_SOCKET_IFNAME={chosen}")
    if not nccl_in_use:
        return Check("network (nccl)", OK, "not used: this torch drives no CUDA device")
    infiniband = [name for name in names if name.startswith("ib")]
    others = [name for name in names if name != "lo" and not name.startswith("docker")]
    picked = infiniband or others
    if not picked:
        return Check("network (nccl)", WARNING, "NCCL finds no interface but loopback: one node only",
                     "export NCCL_SOCKET_IFNAME=IFACE to the interface between the nodes")
    return Check("network (nccl)", OK, f"{', '.join(picked)} (NCCL's default: ib* first, else all but lo, docker*)")


def _unmatched_nccl_names(value: str, names: list[str]) -> list[str]:
    """The names of an NCCL_SOCKET_IFNAME that match no interface; an exclusion list (`^...`) always matches."""
    if value.startswith("^"):
        return []
    exact = value.startswith("=")
    wanted = [name for name in value.lstrip("=").split(",") if name]
    return [want for want in wanted
            if not any(name == want if exact else name.startswith(want) for name in names)]
