"""The engine's API key, wherever the config gives it, and whether a reload changed the engine's secrets: the proxy
asks the key on every path (proxy/keys.py), so it must be given the very key the engine runs with, and a reload that
changes it must restart both."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from ...base.yamlfile import ConfigError, InvalidConfig
from ...config import Config
from ..lint.flags import canonical, names_flag
from .prepare import child_secrets

KEY_ENV = "GPUWARDEN_PROXY_API_KEY"  # in the proxy's environment (proxy/keys.py reads it)


def proxy_asks_key(config: Config) -> bool:
    """Whether the proxy asks the engine's key in front of it (vLLM's own check is the one known to skip paths):
    then a key in vLLM's words is refused (prepare.blocking) and each start reads them first (preflight.keyed_flags)."""
    return config.serve.proxy.enabled and config.serve.engine == "vllm"


def engine_key(config: Config) -> str | None:
    """The vLLM engine's API key, as the engine gets it from its environment (serve.env, the credential,
    serve.env_file); None: none, or another engine (vLLM's own check is the one known to skip paths). With the proxy
    on, a key in vLLM's own flags is refused (flags_key_problem), so this is the very key the engine runs with."""
    if config.serve.engine != "vllm":
        return None
    try:
        secrets = child_secrets(config)
    except InvalidConfig:
        secrets = {}  # the engine's start says so, in its own line
    return secrets.get("VLLM_API_KEY") or dict(config.serve.env).get("VLLM_API_KEY") or None


class KeyUnknown(Exception):
    """vLLM's --config file cannot be read here, so the key it may set is unknown; the message is one line."""


def argv_key(config: Config) -> str | None:
    """A key given to vLLM in the config's command and arguments (flags_key)."""
    return flags_key([*config.serve.command, *config.serve.args])


CONFIG_MAX_BYTES = 64 << 10  # a file of flags; a larger one is refused, not parsed on the daemon's loop
SET = "<set>"  # flags_key's answer where a key is given but its value is not read here (in a shell's string)
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*API_KEY=")  # `env VLLM_API_KEY=K vllm ...` in serve.command
SHELL_KEY = re.compile(r"(?<![^\s'\"])--api[-_]k|(?<![A-Za-z0-9_])VLLM_API_KEY=")  # `sh -c '... --api-key K'`


def flags_key(words: Sequence[str]) -> str | None:
    """A key given to vLLM in its words: --api-key in any spelling its parser takes (--api_key, a prefix,
    --api-key.field), the same spellings as keys of the YAML file --config names (vLLM turns each key of it into
    `--KEY VALUE` before it parses: `api-k:`, `"api-key=K": true`), an `NAME_API_KEY=` word (an `env` wrapper),
    or either inside a shell's string (`sh -c '... --api-key K'`; SET, its value unread). Raises KeyUnknown where
    such a file cannot be read or parsed here (one of serve.user's own, 0600, is unreadable to root under the unit;
    one over CONFIG_MAX_BYTES is not parsed)."""
    words = list(words)
    expanded: list[str] = []
    for i, word in enumerate(words):
        expanded.append(word)
        flag, _, value = canonical(word).partition("=")
        if flag != "--config":
            continue
        value = value or (words[i + 1] if i + 1 < len(words) else "")
        expanded += config_words(os.path.join("/", value))  # relative: to the engine's working directory, /
    found = None
    for i, word in enumerate(expanded):
        if names_flag(word, "--api-key", prefix=True):
            value = word.partition("=")[2] if "=" in word else (expanded[i + 1] if i + 1 < len(expanded) else "")
            found = value or SET
        elif ENV_KEY.match(word):
            found = word.partition("=")[2] or SET
        elif any(c.isspace() for c in word) and SHELL_KEY.search(word):
            found = SET
    return found


def config_words(path: str) -> list[str]:
    """The words vLLM makes of its --config file: `--KEY VALUE` for each key, each item of a list after it, a bare
    `--KEY` for true. KeyUnknown where it cannot be read or parsed here."""
    import yaml  # noqa: PLC0415

    from ...base import smallfile  # noqa: PLC0415

    try:
        data = smallfile.read(path, CONFIG_MAX_BYTES, follow=True)
        doc = yaml.load(data, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if data is not None else None
    except (smallfile.Unreadable, OSError, yaml.YAMLError, RecursionError, ValueError) as exc:
        raise KeyUnknown(f"vLLM's --config file {path} cannot be read here ({type(exc).__name__}: "
                         f"{str(exc)[:200]}): the API key it may set is unknown to the proxy") from None
    if data is None:
        raise KeyUnknown(f"vLLM's --config file {path} does not exist here: the API key it may set is unknown to "
                         "the proxy")
    if not isinstance(doc, (dict, type(None))):
        raise KeyUnknown(f"vLLM's --config file {path} is not a mapping of flags here: the API key it may set "
                         "is unknown to the proxy")
    out: list[str] = []
    for key, value in (doc or {}).items():
        flag = f"--{key}"
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            out += [flag, *(str(v) if v not in (None, "") else SET for v in value)] if value else [flag]
        else:
            out += [flag, str(value) if value not in (None, "") else SET]
    return out


KEY_FIX = "give the key in VLLM_API_KEY (serve.env_file or the systemd credential), or let root read the file"
FLAGS_FIX = "give it as VLLM_API_KEY in serve.env_file or the systemd credential instead"


def flags_key_problem(words: Sequence[str]) -> tuple[str, str] | None:
    """Why vLLM's flags cannot run behind the proxy, and the fix: they give it an API key, or a --config file that
    cannot be read here; None: they give none. The proxy asks the key on every path, so it must know the very key
    the engine runs with, and only the engine's environment is fixed at its start: a key in its flags came from a
    file vLLM reads again at each start, which an edit without a reload changes behind the proxy (attacker 15: every
    client then refused, or vLLM's unguarded paths open with the key unasked)."""
    try:
        key = flags_key(words)
    except KeyUnknown as exc:
        return str(exc), KEY_FIX
    if key is None:
        return None
    return ("with the proxy on, vLLM's flags give it an API key (--api-key, or api-key in its --config file), "
            "which the proxy cannot follow", FLAGS_FIX)


def secrets_changed(config: Config, running: Mapping[str, str]) -> bool:
    """Whether the engine's secrets (the credential, serve.env_file) differ from those the running engine got: a key
    rotated in serve.env_file then restarts the engine with the proxy, as a handover does, instead of the proxy alone
    on the new key and the engine on the old (attacker 13: every client refused). A secrets file that cannot be read
    now changes nothing here (the start says so)."""
    try:
        secrets = child_secrets(config)
    except ConfigError:
        return False
    if any(running.get(name) != value for name, value in secrets.items()):
        return True
    # a key taken out of the file: the engine still has it, and the proxy would ask none
    return "VLLM_API_KEY" in running and "VLLM_API_KEY" not in secrets and \
        "VLLM_API_KEY" not in dict(config.serve.env)
