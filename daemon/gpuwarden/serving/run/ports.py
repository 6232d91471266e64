"""Who listens on a TCP port: so that only our child's process group is ever taken for the child.

Any local process can bind serve.port before vLLM does and answer /health.
The kernel's socket tables (/proc/net/tcp, tcp6) name the listening socket's
inode, and /proc/PID/fd names the processes holding it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import pwd
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

from ...base.safetext import visible

LISTEN = "0A"


# Past either cap a reader gives up rather than guess from part of a table. Lines of a table (any client of the
# API port adds one): 500,000 unrelated lines cost a read and a substring scan. Lines that mention the port
# (each one split and parsed; a local user can open thousands, as connections between their own sockets on
# that port number): an engine holds one per rank's process, so 10,000 is far past any real one, and what a
# read then costs stays small (499,999 such lines cost 2.5 s of CPU and 87 MiB a read).
MAX_LINES = 500_000  # a table
MAX_PORT_LINES = 10_000  # a table, for peers()


class TooManyLines(Exception):
    """A socket table holds more lines than a reader takes."""


def _lines_of(port: int, proc: str, table: str, port_cap: int | None) -> Iterator[list[str]]:
    """The fields of each line of /proc/net/TABLE that mentions port (a table that cannot be read: none). Raises
    TooManyLines past MAX_LINES lines, or past port_cap lines that mention the port. Every connection of the host
    is a line, so a line is split only when it holds ':PORT ' (a substring test): 28,000 unrelated connections
    cost a read of the table and a scan, not 28,000 splits."""
    needle = f":{port:04X} "
    matched = 0
    try:
        with open(Path(proc, "net", table), encoding="ascii", errors="replace") as lines:
            next(lines, None)  # the header
            for n, line in enumerate(lines):
                if n >= MAX_LINES:
                    raise TooManyLines(table)
                if needle in line:
                    matched += 1
                    if port_cap is not None and matched > port_cap:
                        raise TooManyLines(table)
                    fields = line.split()
                    if len(fields) > 9:
                        yield fields
    except OSError:
        return


def listening_sockets(port: int, proc: str = "/proc", host: str | None = None) -> dict[int, int]:
    """inode -> owner uid of the sockets listening on port; with host, only those that take its connections
    (covering). Each table is read on its own, with no cap on the lines that mention the port (a local user
    can open thousands of connections to it; a listener costs a dict entry): past MAX_LINES a table gives what
    it held so far, which is all its listeners (the kernel lists its listening sockets first)."""
    on = None if host is None else covering(host)
    found = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(TooManyLines):
            for f in _lines_of(port, proc, table, None):
                if f[3] == LISTEN and int(f[1].rsplit(":", 1)[1], 16) == port:
                    with contextlib.suppress(ValueError, OSError):
                        if on is None or _address(f[1].rsplit(":", 1)[0]) in on:
                            found[int(f[9])] = int(f[7])
    return found


def covering(host: str) -> frozenset[str] | None:
    """The listening addresses, as _address writes them, that take connections to host: its own address and
    its family's wildcard. Never "::" for an IPv4 host: a "::" listener takes IPv4 too only without
    IPV6_V6ONLY, which /proc/net/tcp6 does not show, and anyone may bind [::]:PORT with it beside ours. A name
    is every address it resolves to (the child may bind, and a client reach, any of them). None: host does not
    resolve, and every listener on the port counts."""
    try:
        return _resolve(host)
    except (OSError, UnicodeError):
        return None


@functools.lru_cache(maxsize=32)
def _resolve(host: str) -> frozenset[str]:
    """covering()'s answer, kept: a name is looked up once (a liveness probe runs on the daemon's loop), a
    numeric address needs no look-up (AI_NUMERICHOST). Raises, so that a failed look-up is not kept."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    found = set()
    for family, _, _, _, address in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            text = _text(socket.inet_pton(family, address[0].split("%")[0]))  # fe80::1%eth0: the table has no scope
            found |= {text, "::" if ":" in text else "0.0.0.0"}
    if not found:
        raise OSError(f"{host}: no IPv4 or IPv6 address")
    return frozenset(found)


ESTABLISHED = "01"


def _address(hexed: str) -> str:
    """/proc/net/tcp's address (IPv4: one little-endian word; IPv6: four), as text; v4-mapped IPv6 as IPv4."""
    raw = bytes.fromhex(hexed)
    return _text(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def _text(raw: bytes) -> str:
    """A packed IPv4 or IPv6 address as text; v4-mapped IPv6 as IPv4 (a socket bound to it takes IPv4)."""
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff\xff":
        raw = raw[12:]
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def peers(port: int, uid: int, proc: str = "/proc", accepted: bool = True) -> dict[int, str] | None:
    """socket inode -> remote address of uid's established connections accepted on local port (accepted), or
    made to remote port (not accepted): a multi-node engine's rendezvous, to which each rank's process holds
    one connection while the engine lives. The inode tells one connection from another of the same address.
    None if a table has more than MAX_LINES lines, or MAX_PORT_LINES on the port: a partial table could hide a rank.

    An accepted socket carries the listener's uid whoever connected, so on the head uid alone lets any local
    user's connection pass; where the connecting end is on this host too, its own line is in the table with
    the connecting process's uid, and a connection whose connecting end is another uid's is left out.

    Cost: a read of both tables (_lines_of), so this runs off the daemon's loop (a Background job), once per
    liveness period at most."""
    found: dict[int, tuple[str, int]] = {}
    strangers: set[tuple[str, int]] = set()  # the connecting ends, on this host, of other uids
    try:
        for fields in (f for table in ("tcp", "tcp6") for f in _lines_of(port, proc, table, MAX_PORT_LINES)):
            if fields[3] != ESTABLISHED:
                continue
            local, remote = fields[1].rsplit(":", 1), fields[2].rsplit(":", 1)
            with contextlib.suppress(ValueError, OSError):
                ours = fields[7] == str(uid)
                if accepted and int(remote[1], 16) == port and not ours:
                    strangers.add((_address(local[0]), int(local[1], 16)))
                # inode 0: queued, not yet accepted (held by no process, so no rank's connection yet)
                if ours and fields[9] != "0" and int((local if accepted else remote)[1], 16) == port:
                    found[int(fields[9])] = (_address(remote[0]), int(remote[1], 16))
    except TooManyLines:
        return None
    return {inode: end[0] for inode, end in found.items() if end not in strangers}


class Unseen(Exception):
    """/proc/PID/fd of these processes cannot be read (another uid, and no CAP_SYS_PTRACE, as under the unit)."""


def holders(inodes: set[int], pids: Iterable[int] | None = None, proc: str = "/proc") -> list[int]:
    """The processes (of pids, or all we may look at) with one of these sockets open. Raises Unseen when
    pids were given and none of their fd tables could be read."""
    if not inodes:
        return []
    wanted = {f"socket:[{inode}]" for inode in inodes}
    candidates = list(pids) if pids is not None else [int(p.name) for p in Path(proc).iterdir() if p.name.isdigit()]
    found, denied = [], 0
    for pid in candidates:
        try:
            for fd in os.scandir(f"{proc}/{pid}/fd"):
                with contextlib.suppress(FileNotFoundError):  # closed while we looked
                    if os.readlink(fd.path) in wanted:
                        found.append(pid)
                        break
        except PermissionError:  # the listing, or (without CAP_SYS_PTRACE) each link, is refused
            denied += 1
        except OSError:
            continue  # gone
    if pids is not None and candidates and denied == len(candidates):
        raise Unseen(candidates)
    return found


def port_free(host: str, port: int) -> bool:
    """True if we could bind host:port now (nothing listens there)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def describe(pid: int, proc: str = "/proc") -> str:
    """'pid 1234 (user bob, python3)', as far as /proc tells."""
    try:
        uid = os.stat(f"{proc}/{pid}").st_uid
        # Any bytes its owner chose (prctl PR_SET_NAME): not UTF-8, or a newline and `STOPPING=1` for STATUS=.
        comm = Path(proc, str(pid), "comm").read_bytes().removesuffix(b"\n").decode("utf-8", "replace")
    except OSError:
        return f"pid {pid}"
    return f"pid {pid} ({_user(uid)}, {visible(comm)})"


def who_listens(port: int, proc: str = "/proc", host: str | None = None) -> str:
    """A readable account of the listeners on port, for an error line: with host, those that take its
    connections (covering), or where none does, every one on the port."""
    sockets = listening_sockets(port, proc, host) or listening_sockets(port, proc)
    pids = holders(set(sockets), proc=proc)
    if pids:
        return ", ".join(describe(pid, proc) for pid in pids)
    owners = sorted(set(sockets.values()))
    return ", ".join(f"a process of {_user(uid)}" for uid in owners) or "a process we cannot see"


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"
