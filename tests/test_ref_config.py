"""The configuration reference (docs/reference/configuration.md) and gpuwarden.yaml(5)
(packaging/man/gpuwarden.yaml.5): committed as docs/gen/config_ref.py writes them, with an entry for every key the
config has, found here without the generator's walk, and a man page man(1) renders without a warning."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "gen"))

import config_ref  # noqa: E402
from gpuwarden import config as configmod  # noqa: E402
from gpuwarden.base import webconfig  # noqa: E402
from gpuwarden.base.yamlfile import InvalidConfig  # noqa: E402
from gpuwarden.tune import tunables  # noqa: E402

REGENERATE = "run python3 docs/gen/config_ref.py and commit what it writes"
UNKNOWN = "zz_not_a_key"
# A config that sets every conditional part: multi-node serving (with rank, which is optional), the proxy, an
# override of every per-GPU setting, an explicit command.
FULL = {
    "serve": {"enabled": True, "model": "m", "command": ["vllm", "serve"], "proxy": {"enabled": True},
              "nodes": {"count": 2, "hosts": ["10.0.0.1", "10.0.0.2"], "rank": 0, "interface": "eth1"},
              "container": {"image": "localhost/vllm-cpu:v0.32"}},
    "tuning": {"gpus": {"0": {t.key: t.config_value(t.default) for t in tunables.TUNABLES}}},
}
# What serve.nodes excludes: an engine at rest while idle (one host, the proxy in front).
FULL_ONE_HOST = {"serve": {"enabled": True, "model": "m", "proxy": {"enabled": True}, "idle": {"after_s": 60}}}
# Mappings whose keys are the user's (a variable name, a GPU): one entry for the mapping, none per key.
FREE_MAPPINGS = ("serve.env", "tuning.gpus")
RELOADS = {what for what, _ in config_ref.RELOADS} | set(config_ref.RELOAD_NOTES.values())


@pytest.fixture(scope="module")
def entries():
    return config_ref.entries()


def test_committed_pages_are_what_the_generator_writes():
    for path, text in config_ref.pages().items():
        assert (ROOT / path).read_text() == text, f"{path} is stale: {REGENERATE}"


def _flat(value: dict, prefix: str = "") -> set[str]:
    """Dotted keys of a nested mapping; a tuning.gpus key is ID; a free mapping is a key of its own."""
    out = set()
    for key, item in value.items():
        dotted = prefix + (config_ref.ID if prefix == "tuning.gpus." else key)
        if isinstance(item, dict) and item and dotted != "serve.env":
            out |= _flat(item, dotted + ".") | ({dotted} & set(FREE_MAPPINGS))
        else:
            out.add(dotted)
    return out


def _sections(value: dict, path: tuple = ()) -> list[tuple]:
    """The paths of the mappings of named keys in an effective config (free mappings left out, not what is in
    them: tuning.gpus.0 is one)."""
    out = [] if ".".join(path) in FREE_MAPPINGS else [path]
    for key, item in value.items():
        if isinstance(item, dict):
            out += _sections(item, path + (key,))
    return out


def _with(value: dict, path: tuple, key: str, item) -> dict:
    """A deep copy of value with value[path][key] = item."""
    value = yaml.safe_load(yaml.safe_dump(value))
    at = value
    for part in path:
        at = at.setdefault(part, {})
    at[key] = item
    return value


def _accepted(errors) -> set[str]:
    """The keys each section's 'unknown key' error says it allows."""
    keys = set()
    for error in errors:
        if error.message == "unknown key":
            section = error.key.rpartition(".")[0]
            section = re.sub(r"^tuning\.gpus\.[^.]+", f"tuning.gpus.{config_ref.ID}", section)
            keys |= {f"{section}.{k}" if section else k for k in error.allowed.removeprefix("allowed: ").split(", ")}
    return keys


def config_keys() -> set[str]:
    """Every key of gpuwarden.yaml, without the generator: the effective config of FULL and of FULL_ONE_HOST
    (Config.as_dict), and every key each of their sections says it allows when it is given one it does not know."""
    return _keys_of(FULL) | _keys_of(FULL_ONE_HOST)


def _keys_of(full: dict) -> set[str]:
    effective = configmod.parse_text(yaml.safe_dump(full)).as_dict()
    keys = _flat(effective)
    doc = effective
    sections = _sections(effective)
    for path in sections:
        doc = _with(doc, path, UNKNOWN, 1)
    with pytest.raises(InvalidConfig) as caught:
        configmod.parse_text(yaml.safe_dump(doc))
    unknown = [e for e in caught.value.errors if e.key.rpartition(".")[2] == UNKNOWN]
    assert len(unknown) == len(sections), "every section refuses a key it does not know"
    return keys | _accepted(unknown)


def web_keys(tmp_path: Path) -> set[str]:
    file = tmp_path / "web.yml"
    file.write_text(yaml.safe_dump({UNKNOWN: 1, "tls_server_config": {UNKNOWN: 1}}))
    with pytest.raises(InvalidConfig) as caught:
        webconfig.load(file)
    return _accepted(caught.value.errors)


def test_every_key_has_an_entry(entries, tmp_path):
    documented = {e.key for e in entries if e.file == config_ref.CONFIG}
    keys = config_keys()
    assert {"serve.nodes.rank", "serve.proxy.listen", "tuning.gpus.ID.power_limit_w", "serve.args"} <= keys
    sections = {k.rpartition(".")[0] for k in documented}
    missing = sorted(k for k in keys if k not in documented and k not in sections)
    assert not missing, f"keys without an entry: {missing}"
    stale = sorted(documented - keys)
    assert not stale, f"entries the parser does not accept: {stale}"
    web = {e.key for e in entries if e.file == config_ref.WEB}
    assert {k for k in web_keys(tmp_path) if k not in {"tls_server_config"}} == web


def test_every_entry_is_complete(entries):
    for e in entries:
        assert e.type and e.default and e.example and e.meaning, e
        assert e.reload in RELOADS, e
    by_key = {e.key: e for e in entries}
    assert by_key["serve.args"].reload == "restarts the engine"
    assert by_key["serve.proxy.listen"].reload == "restarts the proxy only"
    assert by_key["metrics.listen"].reload == "needs a restart of the daemon"
    assert by_key["tuning.power_limit_w"].reload == "re-plans the tuning"
    assert by_key["alerts.for_s"].reload == "applies at once"
    assert by_key["poll_interval_s"].accepts == "number: 0.05-3600 s"
    assert by_key["serve.port"].default == "8000"
    # The hand-written tables name only real keys: a key renamed in config.py leaves none of them stale.
    for table in (config_ref.SHAPES, config_ref.DEFAULTS, config_ref.RANGES, config_ref.MEANINGS,
                  config_ref.EXAMPLES, config_ref.RELOAD_NOTES):
        assert set(table) <= set(by_key), set(table) - set(by_key)


def test_every_example_parses(entries):
    for e in entries:
        if e.file != config_ref.CONFIG or e.key == "metrics.web_config":  # that one loads a file of its own
            continue
        path = tuple("0" if p == config_ref.ID else p for p in e.key.split("."))
        full = FULL_ONE_HOST if path[:2] == ("serve", "idle") else FULL
        doc = _with(full, path[:-1], path[-1], yaml.safe_load(e.example))
        if path[:2] == ("serve", "nodes") and path[-1] == "head":
            del doc["serve"]["nodes"]["hosts"]  # head with rank, instead of hosts
        configmod.parse_text(yaml.safe_dump(doc))


def test_every_entry_is_on_both_pages(entries):
    page = (ROOT / config_ref.PAGE).read_text()
    man = (ROOT / config_ref.MAN).read_text()
    for e in entries:
        assert f"### `{e.key}`" in page, e.key
        assert f".TP\n\\fB{e.key.replace('-', chr(92) + '-')}\\fR\n" in man, e.key


@pytest.mark.process
def test_the_man_page_renders_without_warnings():
    if shutil.which("man") is None:
        pytest.fail("man(1) is missing: apt install man-db groff-base")
    env = dict(os.environ, LC_ALL="C.UTF-8", MANROFFSEQ="", MANWIDTH="80")
    # As lintian checks a page: groff's warnings on, the output thrown away, stderr must stay empty.
    checked = subprocess.run(["man", "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", str(ROOT / config_ref.MAN)],
                             capture_output=True, text=True, env=env, timeout=60, check=False)
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr
    shown = subprocess.run(["man", "-P", "cat", "-l", str(ROOT / config_ref.MAN)], capture_output=True, text=True,
                           env=env, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    assert "serve.nodes.hosts" in shown.stdout and "gpuwarden.yaml - the configuration of gpuwarden" in shown.stdout
