"""Config validation: a corpus of bad configs, each must exit 78 naming FILE:LINE and key."""

import dataclasses
import json
import shutil
import subprocess

import pytest
import yaml

from conftest import DEFAULT_CONFIG, gpuwarden_cmd, subprocess_env
from gpuwarden import config

# (case id, file text, expected line, expected key, fragment of the message)
BAD = [
    ("unknown-top-key", "poll_interval_s: 1\nfoo: 2\n", 2, "foo", "unknown key"),
    ("unknown-tuning-key", "tuning:\n  apply: true\n  gpu_clock: max\n", 3, "tuning.gpu_clock", "unknown key"),
    ("unknown-gpu-key", "gpu:\n  backend: nvml\n  driver: x\n", 3, "gpu.driver", "unknown key"),
    ("backend-bad-choice", "gpu:\n  backend: cuda\n", 2, "gpu.backend", "not a valid choice"),
    ("backend-wrong-type", "gpu:\n  backend: 3\n", 2, "gpu.backend", "expected a non-empty string"),
    ("gpu-not-mapping", "gpu: nvml\n", 1, "gpu", "expected a mapping"),
    ("tuning-not-mapping", "tuning: [1, 2]\n", 1, "tuning", "expected a mapping"),
    ("poll-string", "poll_interval_s: fast\n", 1, "poll_interval_s", "expected a number"),
    ("poll-negative", "poll_interval_s: -1\n", 1, "poll_interval_s", "out of range"),
    ("poll-zero", "poll_interval_s: 0\n", 1, "poll_interval_s", "out of range"),
    ("poll-bool", "poll_interval_s: true\n", 1, "poll_interval_s", "expected a number"),
    ("counters-too-small", "counters_interval_s: 0.1\n", 1, "counters_interval_s", "out of range"),
    ("apply-string", "tuning:\n  apply: \"yes please\"\n", 2, "tuning.apply", "expected true or false"),
    ("apply-number", "tuning:\n  apply: 1\n", 2, "tuning.apply", "expected true or false"),
    ("persistence-string", "tuning:\n  persistence_mode: \"on\"\n", 2, "tuning.persistence_mode",
     "expected true or false"),
    ("clocks-min-above-max", "tuning:\n  gpu_clocks: [3090, 2400]\n", 2, "tuning.gpu_clocks", "is above max"),
    ("clocks-one-value", "tuning:\n  gpu_clocks: [3090]\n", 2, "tuning.gpu_clocks", "a list of 1"),
    ("clocks-three-values", "tuning:\n  gpu_clocks: [1, 2, 3]\n", 2, "tuning.gpu_clocks", "a list of 3"),
    ("clocks-negative", "tuning:\n  gpu_clocks: [-5, 100]\n", 2, "tuning.gpu_clocks", "out of range"),
    ("clocks-float", "tuning:\n  gpu_clocks: [1500.5, 2000]\n", 2, "tuning.gpu_clocks", "whole MHz"),
    ("clocks-word", "tuning:\n  gpu_clocks: fastest\n", 2, "tuning.gpu_clocks", "not a clock setting"),
    ("clocks-number", "tuning:\n  memory_clocks: 14001\n", 2, "tuning.memory_clocks", "expected a [MIN, MAX] pair"),
    ("clocks-huge", "tuning:\n  memory_clocks: [1, 999999]\n", 2, "tuning.memory_clocks", "out of range"),
    ("power-negative", "tuning:\n  power_limit_w: -10\n", 2, "tuning.power_limit_w", "out of range"),
    ("power-word", "tuning:\n  power_limit_w: lots\n", 2, "tuning.power_limit_w", "expected a number or none"),
    ("power-list", "tuning:\n  power_limit_w: [100]\n", 2, "tuning.power_limit_w", "expected a number"),
    ("restore-string", "tuning:\n  restore_on_stop: sometimes\n", 2, "tuning.restore_on_stop", "true or false"),
    ("override-bad-key", "tuning:\n  gpus:\n    first: {gpu_clocks: max}\n", 3, "tuning.gpus.first",
     "not a GPU index or UUID"),
    ("override-unknown-setting", "tuning:\n  gpus:\n    \"0\":\n      apply: false\n", 4, "tuning.gpus.0.apply",
     "unknown key"),
    ("override-not-mapping", "tuning:\n  gpus:\n    \"1\": max\n", 3, "tuning.gpus.1", "expected a mapping"),
    ("override-bad-clocks", "tuning:\n  gpus:\n    \"1\": {gpu_clocks: [2400, 100]}\n", 3,
     "tuning.gpus.1.gpu_clocks", "is above max"),
    ("duplicate-key", "poll_interval_s: 1\ntuning:\n  apply: true\n  apply: false\n", 4, "tuning.apply",
     "duplicate key (first set on line 3)"),
    ("duplicate-top-key", "tuning: {}\npoll_interval_s: 1\npoll_interval_s: 2\n", 3, "poll_interval_s",
     "duplicate key"),
    ("bad-yaml-indent", "tuning:\n  apply: true\n persistence_mode: true\n", 3, "(yaml)", "invalid YAML"),
    ("bad-yaml-unclosed", "tuning:\n  gpu_clocks: [1, 2\n", 3, "(yaml)", "invalid YAML"),
    ("bad-yaml-tab", "tuning:\n\tapply: true\n", 2, "(yaml)", "invalid YAML"),
    ("empty-file", "", 1, "(file)", "file is empty"),
    ("only-comments", "# nothing here\n", 1, "(file)", "file is empty"),
    ("top-level-list", "- a\n- b\n", 1, "(top level)", "expected a mapping"),
    ("top-level-scalar", "hello\n", 1, "(top level)", "expected a mapping"),
    ("scenario-missing", "gpu:\n  backend: sim\n  scenario: no-such-scenario\n", 3, "gpu.scenario",
     "no scenario named 'no-such-scenario'"),
    ("alerts-unknown", "alerts:\n  for: 3\n", 2, "alerts.for", "unknown key"),
    ("alerts-negative", "alerts:\n  for_s: -1\n", 2, "alerts.for_s", "out of range"),
    ("threshold-percent-bad", "alerts:\n  sm_clock_min_mhz: \"150%\"\n", 2, "alerts.sm_clock_min_mhz",
     "not a percentage"),
    ("threshold-word", "alerts:\n  memory_clock_min_mhz: low\n", 2, "alerts.memory_clock_min_mhz",
     "expected MHz or a percentage"),
    ("busy-over-100", "alerts:\n  busy_utilization_pct: 120\n", 2, "alerts.busy_utilization_pct", "out of range"),
    ("listen-no-port", "metrics:\n  listen: localhost\n", 2, "metrics.listen", "expected HOST:PORT"),
    ("listen-bad-port", "metrics:\n  listen: 127.0.0.1:99999\n", 2, "metrics.listen", "not a valid HOST:PORT"),
    ("metrics-unknown", "metrics:\n  port: 9847\n", 2, "metrics.port", "unknown key"),
    ("python-tag", "poll_interval_s: !!python/object:os.system [ls]\n", 1, "poll_interval_s",
     "unsupported YAML tag"),
    ("python-scalar-tag", "tuning:\n  apply: !!python/name:os.system\n", 2, "tuning.apply", "bad value"),
]


@pytest.mark.parametrize("case,text,line,key,fragment", BAD, ids=[c[0] for c in BAD])
def test_bad_config_exits_78_with_file_line_and_key(cli, write, case, text, line, key, fragment):
    path = write("gpuwarden.yaml", text)
    status, out, err = cli("check", "--config", path)
    assert status == 78
    assert f"{path}:{line}: {key}: " in err, err
    assert fragment in err
    assert "Traceback" not in err + out
    assert all(row.startswith(f"{path}:") for row in err.splitlines()), "every error is one FILE:LINE line"


def test_corpus_is_large_enough():
    assert len(BAD) >= 30


def test_all_errors_are_reported_in_one_pass(cli, write):
    path = write("gpuwarden.yaml", "poll_interval_s: -1\ntuning:\n  apply: 3\n  gpu_clocks: [5, 1]\n")
    status, _, err = cli("check", "-c", path)
    assert status == 78
    assert [row.split(": ")[0] for row in err.splitlines()] == [f"{path}:1", f"{path}:3", f"{path}:4"]


def test_error_line_carries_allowed_values(cli, write):
    path = write("gpuwarden.yaml", "gpu:\n  backend: cuda\n")
    _, _, err = cli("check", "-c", path)
    assert err.strip() == f"{path}:2: gpu.backend: 'cuda' is not a valid choice (allowed: nvml, sim)"


def test_missing_file(cli, tmp_path):
    path = tmp_path / "absent.yaml"
    status, _, err = cli("check", "-c", path)
    assert status == 78
    assert err.startswith(f"{path}:1: (file): file not found")


def test_directory_instead_of_file(cli, tmp_path):
    status, _, err = cli("check", "-c", tmp_path)
    assert status == 78 and f"{tmp_path}:1: (file): is a directory" in err


def test_dropin_error_names_the_dropin_file(cli, write):
    main = write("gpuwarden.yaml", "tuning:\n  apply: true\n")
    dropin = write("conf.d/20-clocks.yaml", "# site override\ntuning:\n  gpu_clocks: [2000, 1000]\n")
    status, _, err = cli("check", "-c", main)
    assert status == 78
    assert err.startswith(f"{dropin}:3: tuning.gpu_clocks: min 2000 MHz is above max 1000 MHz")


def test_dropins_merge_in_lexical_order(write):
    main = write("gpuwarden.yaml", "poll_interval_s: 1\ntuning:\n  gpu_clocks: max\n  power_limit_w: 120\n")
    write("conf.d/20-b.yaml", "tuning:\n  gpu_clocks: [2000, 2000]\n")
    write("conf.d/10-a.yaml", "tuning:\n  gpu_clocks: [1000, 1000]\npoll_interval_s: 0.5\n")
    write("conf.d/ignored.txt", "this: is not yaml config\n")
    cfg = config.load(main)
    assert cfg.tuning.default.gpu_clocks == (2000, 2000)  # 20-b comes after 10-a
    assert cfg.tuning.default.power_limit_w == 120  # untouched keys survive the merge
    assert cfg.poll_interval_s == 0.5
    assert [p.rsplit("/", 1)[-1] for p in cfg.files] == ["gpuwarden.yaml", "10-a.yaml", "20-b.yaml"]


def test_scenario_file_errors_point_into_the_scenario(cli, write):
    scenario = write("bad-scenario.yaml", "name: x\ngpus:\n  - name: G\n    compute_capability: 12.0\n")
    main = write("gpuwarden.yaml", "gpu:\n  backend: sim\n  scenario: bad-scenario.yaml\n")
    status, _, err = cli("check", "-c", main)
    assert status == 78
    assert f"{scenario}:4: gpus.0.compute_capability: expected a quoted" in err


@pytest.mark.process
def test_real_process_exits_78_without_traceback(write):
    path = write("gpuwarden.yaml", "tuning:\n  gpu_clocks: [3090, 2400]\n")
    for command in ("check", "plan", "apply", "run"):
        proc = subprocess.run(gpuwarden_cmd() + [command, "-c", str(path)], capture_output=True, text=True,
                              env=subprocess_env(), timeout=60)
        assert proc.returncode == 78, (command, proc.stderr)
        assert proc.stderr.strip() == f"{path}:2: tuning.gpu_clocks: min 3090 MHz is above max 2400 MHz " \
                                      f"(auto, max, none, or [MIN_MHZ, MAX_MHZ] with 1 <= MIN <= MAX <= 100000)"


GOOD = [
    "gpu:\n  backend: nvml\n",
    "poll_interval_s: 0.25\ncounters_interval_s: 5\ntuning:\n  apply: false\n",
    "tuning:\n  gpu_clocks: [2400, 3090]\n  memory_clocks: max\n  power_limit_w: 130.5\n  restore_on_stop: true\n",
    "tuning:\n  gpu_clocks: none\n  persistence_mode: false\n  gpus:\n    \"1\": {gpu_clocks: [2400, 2400]}\n"
    "    GPU-5c1e0d6a-aaaa-bbbb: {power_limit_w: 120, memory_clocks: none}\n",
    "gpu:\n  backend: sim\n  scenario: dgx-spark\ntuning:\n  gpu_clocks: null\n",
    "alerts:\n  for_s: 0\n  sm_clock_min_mhz: 1200\n  memory_clock_min_mhz: \"75%\"\nmetrics:\n  listen: none\n",
    "metrics:\n  listen: \"[::1]:9999\"\nlog_interval_s: 0\n",
]


@pytest.mark.parametrize("text", GOOD)
def test_good_configs_round_trip(text):
    first = config.parse_text(text)
    again = config.parse_text(yaml.safe_dump(first.as_dict()))
    assert dataclasses.replace(again, files=()) == dataclasses.replace(first, files=())


def test_shipped_default_config_is_valid_and_safe(cli):
    status, out, _ = cli("check", "-c", DEFAULT_CONFIG)
    assert status == 0 and "config OK" in out
    cfg = config.load(DEFAULT_CONFIG)
    assert cfg.gpu.backend == "nvml"
    assert cfg.tuning.apply and cfg.tuning.default.gpu_clocks == "auto"
    assert cfg.tuning.default.power_limit_w is None and not cfg.tuning.restore_on_stop


def test_shipped_default_config_explains_every_key():
    text = DEFAULT_CONFIG.read_text()
    cfg = config.load(DEFAULT_CONFIG).as_dict()
    keys = list(cfg) + [k for section in ("gpu", "tuning", "alerts", "metrics", "serve") for k in cfg[section]]
    keys += list(cfg["serve"]["proxy"])
    for key in keys:
        line = next(i for i, row in enumerate(text.splitlines()) if row.strip().startswith(f"{key}:"))
        assert text.splitlines()[line - 1].strip().startswith("#"), f"{key} has no comment above it"


def test_per_gpu_override_precedence():
    cfg = config.parse_text("tuning:\n  power_limit_w: 100\n  gpus:\n    \"0\": {power_limit_w: 110}\n"
                            "    GPU-abc: {power_limit_w: 120}\n")
    assert cfg.tuning.for_gpu(0, "GPU-abc").power_limit_w == 120  # UUID beats index
    assert cfg.tuning.for_gpu(0, "GPU-other").power_limit_w == 110
    assert cfg.tuning.for_gpu(1, "GPU-other").power_limit_w == 100
    assert cfg.tuning.override_source(0, "GPU-other", "power_limit_w") == ("tuning", "gpus", "0", "power_limit_w")


# -- two listeners on one address and port (issue 51, finding 5) --------------------------------------------------

SERVING = "serve:\n  enabled: true\n  model: /m\n"
APART = ("another port, or another address: 127.0.0.1 and 127.0.0.2 are two, 0.0.0.0 and :: are every address of "
         "the port")


@pytest.mark.parametrize("text, line, key, said", [
    # the two: serve.proxy.listen equal to metrics.listen, serve.port equal to the metrics port
    ("metrics:\n  listen: 127.0.0.1:9000\n" + SERVING + "  proxy: {enabled: true, listen: '127.0.0.1:9000'}\n", 6,
     "serve.proxy.listen", "127.0.0.1:9000 (the proxy) collides with metrics.listen 127.0.0.1:9000 (the metrics "
     "endpoint; g.yaml:2)"),
    ("metrics:\n  listen: 127.0.0.1:9847\n" + SERVING + "  port: 9847\n", 6, "serve.port",
     "127.0.0.1:9847 (the engine's API, on serve.host) collides with metrics.listen 127.0.0.1:9847 (the metrics "
     "endpoint; g.yaml:2)"),
    # metrics.listen left at its default: named as the default
    (SERVING + "  port: 9847\n", 4, "serve.port", "127.0.0.1:9847 (the engine's API, on serve.host) collides with "
     "metrics.listen 127.0.0.1:9847 (the metrics endpoint; the default)"),
    # a wildcard takes the port on every address, IPv4's and IPv6's alike
    ("metrics:\n  listen: 0.0.0.0:8000\n" + SERVING, 2, "metrics.listen", "0.0.0.0:8000 (the metrics endpoint) "
     "collides with serve.port 127.0.0.1:8000 (the engine's API, on serve.host; the default)"),
    ("metrics:\n  listen: '[::]:8000'\n" + SERVING + "  host: 10.0.0.5\n", 6, "serve.port", "10.0.0.5:8000 (the "
     "engine's API, on serve.host) collides with metrics.listen [::]:8000 (the metrics endpoint; g.yaml:2)"),
    ("metrics:\n  listen: '[::1]:8000'\n" + SERVING + "  host: '::'\n", 6, "serve.port", "[::]:8000 (the engine's "
     "API, on serve.host) collides with metrics.listen [::1]:8000 (the metrics endpoint; g.yaml:2)"),
    # one address however it is spelled; a listener left at its default: the line is at the one the file sets
    ("metrics:\n  listen: '[::ffff:127.0.0.1]:8001'\n" + SERVING + "  proxy: {enabled: true}\n", 2,
     "metrics.listen", "[::ffff:127.0.0.1]:8001 (the metrics endpoint) collides with serve.proxy.listen "
     "127.0.0.1:8001 (the proxy; the default)"),
    # the head's rendezvous (vLLM's --master-port, Ray's GCS) listens on every address of its port
    ("metrics:\n  listen: 127.0.0.2:29500\n" + SERVING + "  nodes: {rank: 0, head: 10.0.0.1}\n", 2,
     "metrics.listen", "127.0.0.2:29500 (the metrics endpoint) collides with serve.nodes.port *:29500 (the head's "
     "rendezvous, on every address; the default)"),
    (SERVING + "  port: 8123\n  nodes:\n    rank: 0\n    head: 10.0.0.1\n    port: 8123\n", 8, "serve.nodes.port",
     "*:8123 (the head's rendezvous, on every address) collides with serve.port 127.0.0.1:8123 (the engine's API, "
     "on serve.host; g.yaml:4)"),
    (SERVING + "  proxy: {enabled: true, listen: '127.0.0.1:8000'}\n", 4, "serve.proxy.listen", "127.0.0.1:8000 "
     "(the proxy) collides with serve.port 127.0.0.1:8000 (the engine's API, on serve.host; the default)"),
    # a name is never looked up: it may be any address of its port
    (SERVING + "  host: localhost\n  proxy: {enabled: true, listen: '127.0.0.1:8000'}\n", 5, "serve.proxy.listen",
     "127.0.0.1:8000 (the proxy) collides with serve.port localhost:8000 (the engine's API, on serve.host; "
     "g.yaml:4)"),
])
def test_two_listeners_on_one_address_and_port_are_one_line_naming_both_keys_and_files(text, line, key, said):
    from gpuwarden.base.yamlfile import InvalidConfig

    with pytest.raises(InvalidConfig) as caught:
        config.parse_text(text, "g.yaml")
    assert [str(e) for e in caught.value.errors] == [f"g.yaml:{line}: {key}: {said}: two listeners cannot share "
                                                     f"one address and port ({APART})"]


@pytest.mark.parametrize("text", [
    "metrics:\n  listen: 127.0.0.2:8000\n" + SERVING,  # an address is part of a port
    "metrics:\n  listen: '[::1]:8000'\n" + SERVING,
    "metrics:\n  listen: 127.0.0.1:8001\n" + SERVING + "  proxy: {listen: '127.0.0.1:8001'}\n",  # the proxy is off
    "metrics:\n  listen: 127.0.0.1:8000\nserve:\n  model: /m\n",  # serving is off: nothing listens on serve.port
    "metrics:\n  listen: none\n" + SERVING + "  port: 9847\n",
    SERVING + "  proxy: {enabled: true, listen: '127.0.0.2:8000'}\n",
])
def test_listeners_apart_by_address_or_not_listening_at_all_are_fine(text):
    config.parse_text(text, "g.yaml")


def test_check_refuses_a_collision_across_files_with_exit_78(cli, write):
    main = write("gpuwarden.yaml", "metrics:\n  listen: 127.0.0.1:9000\n")
    dropin = write("conf.d/50-proxy.yaml", SERVING + "  proxy:\n    enabled: true\n    listen: 0.0.0.0:9000\n")
    status, out, err = cli("check", "-c", main)
    assert status == 78 and out == ""
    assert err.splitlines() == [f"{dropin}:6: serve.proxy.listen: 0.0.0.0:9000 (the proxy) collides with "
                                f"metrics.listen 127.0.0.1:9000 (the metrics endpoint; {main}:2): two listeners "
                                f"cannot share one address and port ({APART})"]


def test_a_reload_to_a_collision_is_refused_and_the_daemon_keeps_its_config(write, tmp_path, monkeypatch, caplog):
    """The daemon's start and reload read the config through the same config.load as check."""
    from gpuwarden.backends import open_configured
    from gpuwarden.gpu.sim.backend import ManualClock
    from gpuwarden.service.daemon import Daemon

    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))
    path = write("gpuwarden.yaml", "gpu: {backend: sim, scenario: rtx-pro-4000-headless}\nmetrics: {listen: none}\n"
                                   "tuning: {apply: false}\n")
    cfg = config.load(path)
    daemon = Daemon(cfg, open_configured(cfg, ManualClock()), reload=lambda: config.load(path))
    path.write_text(path.read_text().replace("listen: none", "listen: '127.0.0.1:8000'") + SERVING)
    caplog.set_level("INFO")
    daemon.changes.reload()
    assert daemon.config is cfg
    assert f"reload failed, still running the previous config: {path}:2: metrics.listen: 127.0.0.1:8000 (the " \
           "metrics endpoint) collides with serve.port" in caplog.text


def test_check_warns_where_refuse_after_ends_is_not_below_the_crash_loop(write, cli):
    """A proxy that refuses a client only at crash_loop_failures ends or later lets one client take the engine to
    FATAL: the user's choice, so a warning naming the key, and the check passes."""
    def check(serve: str, *args: str):
        path = write("g.yaml", f"gpu: {{backend: sim, scenario: dgx-spark}}\nserve:\n{serve}")
        return cli("check", "-c", path, *args)

    status, out, err = check("  crash_loop_failures: 5\n  proxy:\n    enabled: true\n    refuse_after_ends: 5\n")
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert status == 0 and "config OK" in out and len(warnings) == 1, out
    assert "g.yaml:6: serve.proxy.refuse_after_ends: 5 is not below serve.crash_loop_failures (5)" in warnings[0]
    assert "(1 to 4 refuses it first)" in warnings[0]
    status, out, _ = check("  crash_loop_failures: 5\n  proxy:\n    enabled: true\n    refuse_after_ends: 5\n",
                           "--json")
    found = json.loads(out)["warnings"]
    assert status == 0 and [w["key"] for w in found] == ["serve.proxy.refuse_after_ends"] and found[0]["line"] == 6
    for fine in ("  proxy:\n    enabled: true\n",  # the default, 2, below 5
                 "  crash_loop_failures: 3\n  proxy:\n    enabled: true\n    refuse_after_ends: 2\n",
                 "  proxy:\n    enabled: true\n    refuse_after_ends: 0\n",  # never refuses: a choice said as such
                 "  proxy:\n    enabled: false\n    refuse_after_ends: 9\n"):  # no proxy runs
        status, out, _ = check(fine)
        assert status == 0 and "warning" not in out, (fine, out)


def test_the_config_and_its_dropins_are_read_within_one_budget_and_a_count(write):
    """Attacker 6's finding 4: each file was capped at 1 MiB and their number not at all, and the YAML parser costs
    ~15 s a MiB on the daemon's loop (a reload, a handover's check): two 1 MiB drop-ins passed the 30 s watchdog.
    The main file and its drop-ins now share MAX_CONFIG_BYTES, and there are at most MAX_DROPINS of them."""
    from gpuwarden import config

    path = write("gpuwarden.yaml", "poll_interval_s: 1\n")
    filler = "# " + "x" * (100 * 1024) + "\n"  # each fits alone
    for name in ("10-a", "20-b"):
        write(f"conf.d/{name}.yaml", filler)
    assert config.load(path).poll_interval_s == 1  # 200 KiB in all: read
    third = write("conf.d/30-c.yaml", filler)
    with pytest.raises(config.ConfigError) as refused:
        config.load(path)
    assert str(refused.value) == (f"{third}:1: (file): larger than {(config.MAX_CONFIG_BYTES - 2 * len(filler) - 19) // 1024}"
                                  " KiB (the config and its drop-ins are 256 KiB at most in all (a config is a few KiB))")
    for name in ("10-a", "20-b", "30-c"):
        (path.parent / "conf.d" / f"{name}.yaml").unlink()
    for i in range(config.MAX_DROPINS + 1):
        write(f"conf.d/{i:03}.yaml", "")
    with pytest.raises(config.ConfigError, match=r"conf.d:1: \(file\): 101 drop-ins, more than 100"):
        config.load(path)


def test_a_dropin_replacing_lists_keeps_only_its_own_locations_and_merges_in_one_pass():
    """Attacker 8's finding 4: merge scanned every location of the config for each replaced path (N x M): 56 KB of a
    config and a drop-in held a reload 14.5 s. Now one pass: what a replaced subtree held is dropped, the rest kept."""
    from gpuwarden.base.yamlfile import merge, parse

    n = 20_000
    base = parse("x: [" + ",".join(["0"] * n) + "]\nkept: {a: 1}\nserve: {args: [a, b]}\n", "base.yaml")
    over = parse("y: [" + ",".join(["1"] * n) + "]\nserve: {args: c}\n", "over.yaml")
    merged = merge(base, over)
    assert merged.value["serve"] == {"args": "c"} and len(merged.value["x"]) == n == len(merged.value["y"])
    assert ("serve", "args", "0") not in merged.where and ("serve", "args") in merged.where
    assert ("x", str(n - 1)) in merged.where and ("y", "0") in merged.where and ("kept", "a") in merged.where


@pytest.mark.parametrize("folder", ["profiles.d", "rules.d"])
def test_profiles_d_and_rules_d_are_read_within_a_count_and_a_size_in_all(tmp_path, folder):
    """Attacker 8's finding 3: rules.d and profiles.d had no budget, and a handover's check parses them on the loop
    (1 MiB held it 20 s, a watchdog ping 29.6 s after the one before)."""
    from gpuwarden.base.yamlfile import MAX_DIR_BYTES, MAX_DIR_FILES, InvalidConfig
    from gpuwarden.serving.compose.engines import rules_for
    from gpuwarden.serving.compose.profiles import load_profiles

    load = load_profiles if folder == "profiles.d" else rules_for
    where = tmp_path / folder
    where.mkdir()
    for i in range(MAX_DIR_FILES + 1):
        (where / f"{i:03d}.yaml").write_text("# nothing\n")
    with pytest.raises(InvalidConfig) as many:
        load(where)
    assert f"{MAX_DIR_FILES + 1} " in str(many.value.errors[0]) and len(many.value.errors) == 1
    shutil.rmtree(where)
    where.mkdir()
    for i in range(3):  # each within the 1 MiB a file may be, together past what a folder may be
        (where / f"{i}.yaml").write_text("# " + "x" * (MAX_DIR_BYTES // 2) + "\n")
    with pytest.raises(InvalidConfig) as big:
        load(where)
    assert any("2.yaml" in str(e) and "256 KiB at most in all" in str(e) for e in big.value.errors), big.value.errors
