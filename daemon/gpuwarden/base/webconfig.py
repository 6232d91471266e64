"""TLS and basic auth for /metrics and /status, from a web config file as node_exporter reads it.

    metrics:
      listen: 0.0.0.0:9847
      web_config: /etc/gpuwarden/web.yml

    # web.yml (the same keys as the Prometheus exporter toolkit's --web.config.file)
    tls_server_config:
      cert_file: /etc/gpuwarden/tls/server.crt
      key_file: /etc/gpuwarden/tls/server.key
    basic_auth_users:
      prometheus: $2b$12$...        # a bcrypt hash: htpasswd -nBC 12 "" | tr -d ':\\n'

Passwords are checked with bcrypt (Debian: python3-bcrypt); a check that
passed is remembered, as the toolkit does, so a scrape does not pay bcrypt's
cost every time. The server decides how many checks run at once
(web/server.AuthLine): `remembered` answers without bcrypt, `authorized` is the
whole check, for a worker thread.

What is remembered is HMAC-SHA256 of "user:password" under a random key of
this process's, not a plain SHA-256: SHA-256 is fast to try guesses against,
and the same password would give the same digest on every host and in every
process (a table computed once fits them all); keyed, a digest is this
process's own, as a salted one is. The set survives a handover (SIGUSR2,
re-exec of the same pid; daemon.reexec): hand_over() writes it, with its key,
into a memfd whose number crosses in REMEMBERED_FD_ENV, and take_over() reads
and closes it at the new image's start. The key crosses with the digests, so
the memfd itself is as good as the remembered set to whoever reads it: it is
never in the environment or a file, and only the daemon's user with ptrace
rights over it (root) can open it through /proc.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

from . import yamlfile
from .schema import Reader, type_name
from .yamlfile import ConfigError

log = logging.getLogger("gpuwarden")
REALM = "gpuwarden"
PASSED_REMEMBERED = 64  # credentials that passed a check, kept so a scrape skips bcrypt
REMEMBERED_FD_ENV = "GPUWARDEN_REMEMBERED_FD"  # across a re-exec: the memfd holding the remembered set
_MEMFD_NAME = "gpuwarden-remembered"
_CARRY_MAGIC = b"gpuwarden remembered 1\n"
_DIGEST = 32  # bytes of a SHA-256 (the users' fingerprint, the key, each remembered credential)
_CARRY_MAX = len(_CARRY_MAGIC) + 2 * _DIGEST + PASSED_REMEMBERED * _DIGEST


class _Memory:
    """The credentials that passed, as HMAC-SHA256 under this process's key (or the one handed over)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.key = os.urandom(_DIGEST)
        self.passed: dict[bytes, None] = {}  # oldest first

    def digest(self, decoded: bytes) -> bytes:
        return hmac.new(self.key, decoded, hashlib.sha256).digest()


@dataclass(frozen=True)
class WebConfig:
    file: str
    cert_file: Path | None = None
    key_file: Path | None = None
    users: tuple[tuple[str, str], ...] = ()  # (name, bcrypt hash)
    _memory: _Memory = field(default_factory=_Memory, compare=False, repr=False)

    @property
    def tls(self) -> bool:
        return self.cert_file is not None

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def remembered(self, header: str | None) -> bool | None:
        """Without bcrypt: True when basic auth is off or these credentials passed a check lately, False when
        the header holds no basic credentials, None when only authorized() can tell."""
        if not self.users:
            return True
        decoded = _decode(header)
        if decoded is None:
            return False
        return True if self._remembers(decoded) else None

    def authorized(self, header: str | None) -> bool:
        """True when basic auth is off, or the Authorization header names a user with the right password.
        Unless remembered, this is one bcrypt check (0.1-0.3 s at cost 12): run it off the event loop."""
        if not self.users:
            return True
        decoded = _decode(header)
        if decoded is None:
            return False
        if self._remembers(decoded):
            return True
        try:
            name, _, password = decoded.decode("utf-8").partition(":")
        except UnicodeDecodeError:
            return False
        hashed = dict(self.users).get(name)
        import bcrypt  # only when basic auth is configured (load() checked that it imports)

        # An unknown user is checked against a real hash, the costliest configured, and refused whatever the
        # answer: it costs at least what a wrong password of any user costs, so timing does not tell which
        # names exist (were users' costs to differ, the cheaper users would still show).
        try:
            ok = bcrypt.checkpw(password.encode(), (hashed or _costliest(self.users)).encode())
        except ValueError:  # a NUL in the password (bcrypt 3.2), or over 72 bytes (bcrypt 5)
            return False
        if not ok or hashed is None:
            return False
        memory = self._memory
        with memory.lock:
            # Only right passwords get here, yet bcrypt reads 72 bytes of one, so suffixes make more: a bound.
            if len(memory.passed) >= PASSED_REMEMBERED:
                del memory.passed[next(iter(memory.passed))]
            memory.passed[memory.digest(decoded)] = None
        return True

    def _remembers(self, decoded: bytes) -> bool:
        memory = self._memory
        with memory.lock:
            key = memory.digest(decoded)
            return any(hmac.compare_digest(key, seen) for seen in memory.passed)

    def _fingerprint(self) -> bytes:
        """Of the users and their hashes: a set remembered under other ones (a password changed in web.yml
        since) must not cross."""
        return hashlib.sha256("\n".join(f"{name}:{hashed}" for name, hashed in self.users).encode()).digest()

    def hand_over(self) -> None:
        """Before a re-exec: the remembered set, its key and the users' fingerprint into a memfd for the new
        image (take_over), its number in REMEMBERED_FD_ENV. Close-on-exec until let_inherit(), just before
        execv: no child started meanwhile gets it."""
        memory = self._memory
        with memory.lock:
            if not memory.passed:
                return
            data = _CARRY_MAGIC + self._fingerprint() + memory.key + b"".join(memory.passed)
        fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.environ[REMEMBERED_FD_ENV] = str(fd)

    def _take(self, data: bytes) -> str | None:
        """Remember what hand_over() wrote; None, or why it was left (in words)."""
        body = data[len(_CARRY_MAGIC):]
        if (not data.startswith(_CARRY_MAGIC) or len(data) > _CARRY_MAX or len(body) % _DIGEST
                or len(body) < 2 * _DIGEST):
            return f"not what a handover writes ({len(data)} bytes)"
        if not hmac.compare_digest(body[:_DIGEST], self._fingerprint()):
            return "basic_auth_users changed since: every scraper's password is checked again"
        memory = self._memory
        with memory.lock:
            memory.key = body[_DIGEST:2 * _DIGEST]
            memory.passed = dict.fromkeys(body[i:i + _DIGEST] for i in range(2 * _DIGEST, len(body), _DIGEST))
        return None


def let_inherit() -> None:
    """daemon.reexec, just before execv: the memfd of hand_over() crosses the exec."""
    number = os.environ.get(REMEMBERED_FD_ENV)
    if number is not None:
        os.set_inheritable(int(number), True)


def take_over(web: WebConfig | None) -> None:
    """At the start of a re-executed image: the scrapers the image before it remembered (hand_over), into web
    (none: metrics or basic auth are off now). The memfd is read and closed whatever it holds; an fd that is
    not our memfd is left alone. Anything amiss is one log line, and the scrapers' passwords are checked again."""
    number = os.environ.pop(REMEMBERED_FD_ENV, None)
    if number is None:
        return
    try:
        fd = int(number)
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{_MEMFD_NAME} "):
            raise ValueError(f"fd {fd} is not the handover's memfd")
    except (ValueError, OSError) as exc:
        log.warning("metrics: the remembered scrapers handed over are ignored: %s=%.20r: %s", REMEMBERED_FD_ENV,
                    number, getattr(exc, "strerror", None) or exc)
        return
    try:
        data = os.pread(fd, _CARRY_MAX + 1, 0)
    except OSError as exc:
        data, why = b"", exc.strerror or str(exc)
    else:
        why = "metrics or basic auth are off now" if web is None or not web.users else web._take(data)
    finally:
        os.close(fd)
    if why is not None:
        log.warning("metrics: the remembered scrapers handed over are ignored: %s", why)
        return
    log.info("metrics: %d scraper(s) remembered across the handover", len(web._memory.passed))


def _decode(header: str | None) -> bytes | None:
    """The "user:password" bytes of a basic Authorization header, or None."""
    scheme, _, encoded = (header or "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(encoded, validate=True)
    except ValueError:
        return None


def load(path: Path) -> WebConfig:
    """Read and check a web config file; ConfigError/ConfigErrors as FILE:LINE."""
    doc = yamlfile.load(path)
    if not isinstance(doc.value, dict):
        raise ConfigError(doc.file, 1, "(top level)", f"expected a mapping, got {type_name(doc.value)}")
    r = Reader(doc)
    r.mapping((), ("tls_server_config", "basic_auth_users"))
    tls = r.mapping(("tls_server_config",), ("cert_file", "key_file"))
    cert = key = None
    if tls:
        for name in ("cert_file", "key_file"):
            value = r.string(("tls_server_config", name), None)
            if value is None:
                r.fail(("tls_server_config",), f"missing {name}")
                continue
            file = Path(path).parent / value
            if not file.is_file():
                r.fail(("tls_server_config", name), f"{file} is not a readable file")
            elif name == "cert_file":
                cert = file
            else:
                key = file
    users = []
    for name, hashed in r.mapping(("basic_auth_users",), None).items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            r.fail(("basic_auth_users", name), "expected a bcrypt hash ($2b$...)",
                   "make one with: htpasswd -nBC 12 \"\" | tr -d ':\\n'")
            continue
        users.append((name, hashed))
    if users:
        try:
            import bcrypt  # noqa: F401
        except ImportError:
            r.fail(("basic_auth_users",), "basic auth needs the bcrypt module", "apt install python3-bcrypt")
    r.raise_if_errors()
    config = WebConfig(str(path), cert, key, tuple(users))
    if config.tls:
        try:
            config.ssl_context()
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(str(path), doc.locate(("tls_server_config",))[1], "tls_server_config",
                              f"the certificate and key do not load: {exc}") from None
    return config


def basic_auth_header(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _costliest(users) -> str:
    """The configured hash with the highest bcrypt cost ($2b$12$...: the number after the second $)."""
    def cost(hashed: str) -> int:
        parts = hashed.split("$")
        return int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else 0
    return max((h for _, h in users), key=cost)
