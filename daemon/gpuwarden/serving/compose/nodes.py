"""This node's part of a multi-node engine (serve.nodes): its rank, whether it is the head, the flags and
environment the engine's own multi-node mode needs on it, and the interface its collectives use.

gpuwarden adds no cluster protocol: vLLM's rendezvous (--nnodes/--node-rank/--master-addr/--master-port on
its multiprocessing backend, --headless on the nodes that serve no API) or Ray's joins the nodes; each
node's daemon runs and restarts its own part.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from pathlib import Path

from ...config import Config, NodesConfig, node_address

SYS_NET = Path("/sys/class/net")


@dataclass(frozen=True)
class Role:
    nodes: NodesConfig
    rank: int

    @property
    def head(self) -> bool:
        return self.rank == 0

    @property
    def address(self) -> str | None:
        """This node's own address, where hosts names it (what the engine advertises to its peers)."""
        return self.nodes.hosts[self.rank] if self.nodes.hosts else None

    @property
    def name(self) -> str:
        return "head" if self.head else "worker"

    def describe(self) -> str:
        """'rank 1 of 2 (worker; head 10.0.0.1:29500, backend mp)'"""
        n = self.nodes
        return f"rank {self.rank} of {n.count} ({self.name}; head {n.address}, backend {n.backend})"

    def env(self) -> dict[str, str]:
        """The collectives' interface for NCCL and Gloo, and the address vLLM advertises to its peers
        (VLLM_HOST_IP: vllm/utils/network_utils.py:53, get_ip; without it vLLM guesses from the route to a
        public address, which on a host with a management and a fabric NIC is the wrong one)."""
        env = {}
        if self.nodes.interface:
            env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = self.nodes.interface
        if self.address:
            env["VLLM_HOST_IP"] = self.address
        return env


def is_local_address(address: str) -> bool:
    """True if this host holds address: binding to it succeeds only where one of our interfaces has it. The
    config admits numeric addresses only (config.node_address), so this never waits for a name lookup; any
    other text (empty, a NUL) is not ours."""
    if not address or node_address(address) is None:
        return False
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError as exc:
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EINVAL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
            return False
        raise
    return True


def role_of(config: Config, local=is_local_address) -> Role | None:
    """This node's role (None: one host). The rank is serve.nodes.rank, or the one entry of serve.nodes.hosts
    that is an address of this host; ConfigError when none or several are."""
    nodes = config.serve.nodes
    if nodes is None:
        return None
    if nodes.rank is not None:
        return Role(nodes, nodes.rank)
    mine = [i for i, host in enumerate(nodes.hosts) if local(host)]
    if len(mine) != 1:
        found = "none of them is" if not mine else "entries " + ", ".join(str(i) for i in mine) + " all are"
        raise config.error(("serve", "nodes", "hosts"), f"{found} an address of this host",
                           f"set serve.nodes.rank (0-{nodes.count - 1}) on this node")
    return Role(nodes, mine[0])


@dataclass(frozen=True)
class Interface:
    """What /sys/class/net says of one network interface."""

    name: str
    exists: bool
    up: bool = False
    mtu: int | None = None
    state: str = ""


def interface(name: str, root: Path = SYS_NET) -> Interface:
    """The interface's state and MTU from sysfs (one small file each). A loopback reports operstate
    'unknown' yet carries traffic: IFF_UP in its flags is what says up."""
    if "/" in name or name in (".", "..") or not (root / name).is_dir():
        return Interface(name, False)

    def read(leaf: str) -> str:
        try:
            return (root / name / leaf).read_text()[:64].strip()
        except OSError:
            return ""

    state = read("operstate")
    flags = read("flags")
    up = state == "up" or (state == "unknown" and flags.startswith("0x") and bool(int(flags, 16) & 0x1))
    mtu = read("mtu")
    return Interface(name, True, up, int(mtu) if mtu.isdigit() else None, state)


def reachable(host: str, port: int, timeout: float = 2.0) -> str | None:
    """None if host:port accepts a TCP connection within timeout; else why not, in words."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.timeout:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)
    except (ValueError, UnicodeError) as exc:  # not an address (the config admits numeric ones only)
        return str(exc)


def preflight(role: Role, env: dict[str, str], reach=reachable) -> list[tuple[str, str, str, str]]:
    """(severity, check, message, fix) for this node: the collectives' interface (there, up, its MTU), the
    NCCL/Gloo variables the child gets naming it, and the head's rendezvous answering (from a worker). What
    every node runs (engine version, model) is compared across nodes by the Prometheus rule
    ServingNodesDiffer over gpuwarden_serving_info, not here: one node cannot see the others."""
    n = role.nodes
    found = [("info", "nodes", f"this node is {role.describe()}", "")]
    if n.interface is None:
        found.append(("warning", "nodes interface", "serve.nodes.interface is not set: NCCL and Gloo pick an "
                      "interface themselves, and on a host with a management and a fabric NIC they may pick the "
                      "management one", "set serve.nodes.interface to the NIC the nodes reach each other on"))
    else:
        nic = interface(n.interface)
        if not nic.exists:
            found.append(("error", "nodes interface", f"no network interface {n.interface} on this host",
                          "serve.nodes.interface: one of " + ", ".join(sorted(p.name for p in SYS_NET.iterdir()))
                          if SYS_NET.is_dir() else "an interface of this host"))
        elif not nic.up:
            found.append(("error", "nodes interface", f"{n.interface} is down (operstate {nic.state or '?'})",
                          f"ip link set {n.interface} up, and check its cable or its switch port"))
        else:
            found.append(("ok", "nodes interface", f"{n.interface} is up, MTU {nic.mtu}", ""))
        for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            if env.get(name) != n.interface:
                found.append(("warning", "nodes interface", f"the engine gets {name}={env.get(name, '(unset)')}, "
                              f"not serve.nodes.interface {n.interface}", f"remove {name} from serve.env or the "
                              "profile"))
    if n.hosts and n.head not in n.hosts:
        found.append(("warning", "nodes head", f"serve.nodes.head {n.head} is not in serve.nodes.hosts: the ranks' "
                      "connections to it may come from addresses not listed, and the head counts only those listed "
                      "(a lost rank would go unseen)", "list the addresses the nodes reach the head from in "
                      "serve.nodes.hosts, the head's own first, or leave serve.nodes.head out"))
    if not role.head:
        why = reach(n.head, n.port)
        if why is None:
            found.append(("ok", "nodes head", f"the head's rendezvous {n.address} answers", ""))
        else:
            found.append(("warning", "nodes head", f"the head's rendezvous {n.address} does not answer: {why}",
                          "start the head (this node waits for it); if it runs, open port "
                          f"{n.port} between the nodes"))
    return found
