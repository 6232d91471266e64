"""Secrets for the child (vLLM's API key, a Hugging Face token): where they come from, and never printed.

They come from a root-only file, never from the world-readable config: the
systemd credential `vllm.env` ($CREDENTIALS_DIRECTORY/vllm.env, wired with
LoadCredential= in the unit from /etc/gpuwarden/credentials/vllm.env), or a
file named by serve.env_file. Both hold KEY=VALUE lines. Wherever gpuwarden
prints or serves a command or an environment, secret-looking values are
replaced by "<redacted>".
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

from ...base import smallfile
from ..lint.flags import is_secret, is_secret_flag

CREDENTIAL = "vllm.env"
MAX_BYTES = 64 * 1024
REDACTED = "<redacted>"
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SecretFileError(Exception):
    """The file cannot be used; (line, message) for a FILE:LINE error."""

    def __init__(self, line: int, message: str):
        self.line, self.message = line, message
        super().__init__(message)


USERINFO = re.compile(r"(?<=://)[^/@\s]*:[^/@\s]*@")  # scheme://user:password@host, in any variable


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (REDACTED if is_secret(k) and v else USERINFO.sub(REDACTED + "@", v)) for k, v in env.items()}


SECRET_NAME = re.compile(r"(?:API_KEY|TOKEN|SECRET|PASSWORD)$")  # the names SECRET_ASSIGNMENT below redacts
SECRET_ASSIGNMENT = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*(?:API_KEY|TOKEN|SECRET|PASSWORD)=)(\S*)")
SECRET_IN_SHELL = re.compile(r"(?<![^\s'\"])(--(?:api[-_]k|hf[-_]t|ssl[-_]keyfile[-_]p)[\w.-]*(?:=|\s+))(\S+)")


def redact_argv(argv: Sequence[str]) -> list[str]:
    """argv with every value of a secret flag replaced: `--api-key=X`, and each word after `--api-key` up to the
    next flag (vLLM's --api-key takes several keys); and in any word, a secret's assignment (`VLLM_API_KEY=X`: an
    `env` wrapper in serve.command) and a secret flag's value inside a shell's string (`sh -c '... --api-key X'`;
    attacker 16: both reached the journal and `check` whole)."""
    out, hide = [], False
    for i, arg in enumerate(argv):
        arg = SECRET_ASSIGNMENT.sub(lambda m: m.group(1) + REDACTED, arg)
        if any(c.isspace() for c in arg):
            arg = SECRET_IN_SHELL.sub(lambda m: m.group(1) + REDACTED, arg)
        # After a secret flag its value, whatever it looks like (argparse takes "-4242" as one), then any more
        # words that are not flags (vLLM's --api-key takes several keys).
        first = i > 0 and is_secret_flag(argv[i - 1]) and "=" not in argv[i - 1]
        if hide and (first and not arg.startswith("--") or not arg.startswith("-")):
            out.append(REDACTED)
            continue
        hide = is_secret_flag(arg)
        if hide and "=" in arg:
            out.append(f"{arg.partition('=')[0]}={REDACTED}")
            hide = False
        else:
            out.append(arg)
    return out


def read_env_file(path: Path, owner: int | None = None) -> dict[str, str]:
    """KEY=VALUE lines from a file only its owner (root, or `owner`) can read. Raises SecretFileError."""
    def private(st: os.stat_result) -> None:
        wanted = 0 if owner is None else owner
        if st.st_uid != wanted:
            raise SecretFileError(1, f"owned by uid {st.st_uid}, not {wanted}: anyone who owns it can read the key")
        if st.st_mode & 0o077:
            raise SecretFileError(1, f"mode {stat.S_IMODE(st.st_mode):04o} lets others read it: chmod 600 {path}")

    try:
        data = smallfile.read(path, MAX_BYTES, check=private)  # no link, no FIFO's wait, owner checked first
    except smallfile.Unreadable as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise SecretFileError(1, "is a symbolic link: name the file itself (a link may point at any file "
                                     "the daemon can read)") from None
        if exc.errno is not None:
            raise SecretFileError(1, f"cannot {'read' if exc.st else 'open'}: {exc}") from None
        if not stat.S_ISREG(exc.st.st_mode):
            raise SecretFileError(1, f"is a {_kind(exc.st.st_mode)}, not a regular file") from None
        raise SecretFileError(1, f"larger than {MAX_BYTES} bytes") from None
    if data is None:
        raise SecretFileError(1, "file not found")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SecretFileError(1, "not UTF-8 text") from None
    env: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 is no line end here
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, eq, value = line.partition("=")
        name, value = name.strip(), value.strip()
        if name.startswith("export "):
            name = name[len("export "):].strip()
        if not eq or not NAME.match(name):
            raise SecretFileError(number, "expected KEY=VALUE (the line's content is not shown: it may be secret)")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if "\0" in value:
            raise SecretFileError(number, f"{name}: contains a NUL byte")
        env[name] = value
    return env


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def credentials_file(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The systemd credential vllm.env, when the unit passed one."""
    folder = environ.get("CREDENTIALS_DIRECTORY")
    path = Path(folder, CREDENTIAL) if folder else None
    return path if path is not None and path.exists() else None
