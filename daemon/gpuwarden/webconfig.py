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
(exporter.MetricsServer): `remembered` answers without bcrypt, `authorized`
is the whole check, for a worker thread.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

from . import yamlfile
from .schema import Reader, type_name
from .yamlfile import ConfigError

REALM = "gpuwarden"
PASSED_REMEMBERED = 64  # credentials that passed a check, kept so a scrape skips bcrypt


@dataclass(frozen=True)
class WebConfig:
    file: str
    cert_file: Path | None = None
    key_file: Path | None = None
    users: tuple[tuple[str, str], ...] = ()  # (name, bcrypt hash)
    _passed: dict = field(default_factory=dict, compare=False, repr=False)  # digests, oldest first
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

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
        return True if self._remembers(hashlib.sha256(decoded).digest()) else None

    def authorized(self, header: str | None) -> bool:
        """True when basic auth is off, or the Authorization header names a user with the right password.
        Unless remembered, this is one bcrypt check (0.1-0.3 s at cost 12): run it off the event loop."""
        if not self.users:
            return True
        decoded = _decode(header)
        if decoded is None:
            return False
        key = hashlib.sha256(decoded).digest()
        if self._remembers(key):
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
        with self._lock:
            # Only right passwords get here, yet bcrypt reads 72 bytes of one, so suffixes make more: a bound.
            if len(self._passed) >= PASSED_REMEMBERED:
                del self._passed[next(iter(self._passed))]
            self._passed[key] = None
        return True

    def _remembers(self, key: bytes) -> bool:
        with self._lock:
            return any(hmac.compare_digest(key, seen) for seen in self._passed)


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
