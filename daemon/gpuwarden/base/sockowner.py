"""Who took a TCP connection we opened on this host: the owner uid of the socket at its far end, so that a request
goes only to the user it is meant for.

A port on loopback is not an identity: while the engine restarts, any local user can bind its port (SO_REUSEADDR)
and answer /health. The connection itself says who took it: the accepting end's socket, accepted or still queued,
carries its listener's owner uid. Asked after connect() and before a byte is written, the answer is about the socket
the bytes would go to; a check of the listeners before connect() would leave a window for a squatter to bind.

Two readings, both open to any user (no CAP_SYS_PTRACE, no /proc/PID/fd of another uid):
- sock_diag (NETLINK_SOCK_DIAG): one exact lookup by the connection's addresses, 14 µs a check on the 2-core box
  whatever the host holds (the kernel's hash lookup; benchmarks/RESULTS.md, section 23);
- /proc/net/tcp and tcp6: the kernel prints the whole table, 17 ms at 3,000 sockets and 33 ms at 13,000 (a local
  user can open more). Read only where sock_diag cannot tell: no netlink, or an end still in SYN_RECV (sock_diag
  names no owner for a request socket; the table gives its listener's).
"""

from __future__ import annotations

import errno
import pwd
import socket
import struct
import sys

from . import unixsock

ESTABLISHED, SYN_RECV = 1, 3
SOCK_DIAG_BY_FAMILY, NETLINK_SOCK_DIAG, NLM_F_REQUEST, NLMSG_ERROR = 20, 4, 1, 2
NO_COOKIE = 0xFFFFFFFF
MAPPED = b"\0" * 10 + b"\xff\xff"  # the prefix of an IPv4 address in an IPv6 one
HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2 before its sockid: family, protocol, ext, pad, states
SOCKID = struct.Struct("!HH16s16s")  # inet_diag_sockid: sport, dport, src, dst (network order); then if, cookie
REPLY = struct.Struct("=BBBB")  # inet_diag_msg before its sockid: family, state, timer, retrans
TAIL = struct.Struct("=IIIII")  # after its sockid: expires, rqueue, wqueue, uid, inode
MAX_TABLE_BYTES = 256 << 20  # /proc/net/tcp of 1.7 million sockets; past it, no answer


def owner(near: tuple, far: tuple, proc: str = "/proc") -> int | None:
    """The uid owning the far end of our TCP connection near -> far (getsockname(), getpeername()), where that end
    is a socket of this host (its network namespace) that took the connection: ESTABLISHED, accepted or still in
    its listener's queue, or SYN_RECV (the listener's owner). None: no such socket here (another host or namespace),
    or it is closing already (a closed end has no owner left to say: TIME_WAIT reads uid 0)."""
    near, far = _endpoint(near), _endpoint(far)
    try:
        found = diag(near, far)
        slow = found is not None and found[0] == SYN_RECV  # a request socket: sock_diag names no owner, tables do
    except OSError:  # no netlink here
        found, slow = None, True
    if slow:
        found = table_owner(near, far, proc)
    return found[1] if found is not None and found[0] in (ESTABLISHED, SYN_RECV) else None


def why_not(sock: socket.socket, uid: int | tuple[int, ...], elsewhere: str = "") -> str | None:
    """None when the far end of sock's new connection is a socket of uid (or of one of the uids) on this host; else
    why not, one line that names the owner (elsewhere: what to add where no socket of this host took it). More than
    one uid: a listener one process made and another accepts on (the daemon's kept listener, base/keptlistener.py):
    a connection still queued is its maker's, accept() makes it the accepter's."""
    uids = (uid,) if isinstance(uid, int) else uid
    if sock.family == socket.AF_UNIX:  # the kernel's word for the connection: who listened (SO_PEERCRED)
        found = unixsock.peer_uid(sock)
        if found in uids:
            return None
        try:
            where = f"unix:{sock.getpeername() or '?'}"
        except OSError as exc:  # the listener went away meanwhile (an engine that ends): nobody to name
            return f"the connection cannot be checked ({exc.strerror or exc}): nothing sent"
        if found is None:
            return f"{where} cannot be checked (no SO_PEERCRED): nothing sent"
        return (f"{where} is answered by a socket of {named(found)}, not of the engine's "
                f"{' or '.join(map(named, uids))}: nothing sent to it")
    try:
        near, far = sock.getsockname(), sock.getpeername()
    except OSError as exc:
        return f"the connection cannot be checked ({exc.strerror or exc}): nothing sent"
    found = owner(near, far)
    if found in uids:
        return None
    where = f"[{far[0]}]:{far[1]}" if ":" in far[0] else f"{far[0]}:{far[1]}"
    if found is None:
        return f"{where} was taken by no open socket of this host{elsewhere}: nothing sent"
    return (f"{where} is answered by a socket of {named(found)}, not of the engine's "
            f"{' or '.join(map(named, uids))} (a local user holds the engine's port): nothing sent to it")


def reset_on_close(sock: socket.socket) -> None:
    """Close sock with a reset (SO_LINGER 0): the other end reads no orderly end, and ours keeps no TIME_WAIT."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def named(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _endpoint(address: tuple) -> tuple[int, bytes, int, int]:
    """(family, packed address, port, scope id) of a socket address; an IPv4-mapped IPv6 address as IPv4."""
    host, port = address[0].split("%")[0], address[1]
    scope = address[3] if len(address) > 3 else 0
    if ":" in host:
        raw = socket.inet_pton(socket.AF_INET6, host)
        if raw[:12] == MAPPED:
            return socket.AF_INET, raw[12:], port, 0
        return socket.AF_INET6, raw, port, scope
    return socket.AF_INET, socket.inet_pton(socket.AF_INET, host), port, 0


# -- sock_diag ------------------------------------------------------------------------------------------------------

def diag(near: tuple, far: tuple) -> tuple[int, int] | None:
    """(state, uid) of the far end's socket by one sock_diag lookup (endpoints as _endpoint gives them); None: no
    socket of those four addresses. OSError: netlink cannot answer."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)  # the kernel answers within the send; never wait on it longer
        nl.sendto(diag_request(near, far), (0, 0))
        data, sender = nl.recvfrom(8192)
    if sender[0] != 0:  # only the kernel (port id 0) answers; no user may send to another's sock_diag socket
        raise OSError(errno.EPROTO, "sock_diag: an answer not from the kernel")
    return diag_reply(data, near, far)


def diag_request(near: tuple, far: tuple) -> bytes:
    """The lookup of the socket whose own address is far and whose peer is near (its local end is ours' far)."""
    family = far[0]
    sockid = SOCKID.pack(far[2], near[2], far[1].ljust(16, b"\0"), near[1].ljust(16, b"\0"))
    body = REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid + struct.pack(
        "=III", far[3], NO_COOKIE, NO_COOKIE)
    return HEADER.pack(HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + body


def diag_reply(data: bytes, near: tuple, far: tuple) -> tuple[int, int] | None:
    """(state, uid) from the kernel's answer, if it is about that very socket: a lookup that finds no connected
    socket of those addresses answers the port's listener, or ENOENT."""
    if len(data) < HEADER.size:
        raise OSError(errno.EPROTO, "sock_diag: a short answer")
    length, kind, _, _, _ = HEADER.unpack_from(data)
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, HEADER.size)[0] if len(data) >= HEADER.size + 4 else errno.EPROTO
        if code == errno.ENOENT:
            return None
        raise OSError(code, f"sock_diag: {errno.errorcode.get(code, code)}")
    start = HEADER.size
    if kind != SOCK_DIAG_BY_FAMILY or min(length, len(data)) < start + REPLY.size + SOCKID.size + 12 + TAIL.size:
        raise OSError(errno.EPROTO, "sock_diag: not an answer about a socket")
    family, state, _, _ = REPLY.unpack_from(data, start)
    sport, dport, src, dst = SOCKID.unpack_from(data, start + REPLY.size)
    uid = TAIL.unpack_from(data, start + REPLY.size + SOCKID.size + 12)[3]
    if (sport, dport, _packed(src, family, far), _packed(dst, family, far)) != (far[2], near[2], far[1], near[1]):
        return None  # the port's listener (no connected socket of these addresses), or another socket
    return state, uid


def _packed(raw: bytes, family: int, like: tuple) -> bytes | None:
    """A sockid's 16-byte address spelled as like's packed address is (IPv4 in a dual-stack socket: ::ffff:a.b.c.d)."""
    if len(like[1]) == 16:
        return raw if family == socket.AF_INET6 else None
    if family == socket.AF_INET:
        return raw[:4]
    return raw[12:] if raw[:12] == MAPPED else None


# -- /proc/net/tcp, tcp6 --------------------------------------------------------------------------------------------

def table_owner(near: tuple, far: tuple, proc: str = "/proc") -> tuple[int, int] | None:
    """(state, uid) of the far end's socket from the kernel's tables (tcp for IPv4 sockets, tcp6 for IPv6 ones and
    for dual-stack sockets that took an IPv4 connection); None: not there, or a table cannot be read."""
    for name in (("tcp", "tcp6") if far[0] == socket.AF_INET else ("tcp6",)):
        try:
            with open(f"{proc}/net/{name}", "rb") as table:
                text = table.read(MAX_TABLE_BYTES + 1)
        except OSError:
            continue
        if len(text) > MAX_TABLE_BYTES:
            return None
        found = find_in_table(text, near, far, six=name == "tcp6")
        if found is not None:
            return found
    return None


def hexed(raw: bytes, six: bool) -> str:
    """An address as /proc/net/tcp prints it: each 32-bit word of it in the host's byte order, in hex (IPv4 in tcp6
    as ::ffff:a.b.c.d)."""
    if six and len(raw) == 4:
        raw = MAPPED + raw
    words = (raw[i:i + 4] for i in range(0, len(raw), 4))
    return "".join((w[::-1] if sys.byteorder == "little" else w).hex().upper() for w in words)


def find_in_table(text: bytes, near: tuple, far: tuple, six: bool) -> tuple[int, int] | None:
    """(state, uid) of the line whose local address is far and remote address near, in the text of /proc/net/tcp
    (six: tcp6); None: no such line. Where the kernel lists two (a closed end and a new one of the same addresses
    a moment), an established or queued one counts first."""
    if len(far[1]) == 16 and not six:
        return None  # an IPv6 connection is never in the IPv4 table
    needle = f" {hexed(far[1], six)}:{far[2]:04X} {hexed(near[1], six)}:{near[2]:04X} ".encode()
    found, at = [], text.find(needle)
    while at >= 0:
        end = text.find(b"\n", at)
        fields = text[text.rfind(b"\n", 0, at) + 1:end if end >= 0 else len(text)].split()
        at = text.find(needle, at + 1)
        try:
            found.append((int(fields[3], 16), int(fields[7])))
        except (IndexError, ValueError):
            continue
    return min(found, key=lambda f: f[0] not in (ESTABLISHED, SYN_RECV), default=None)
