"""The .deb, installed with apt into a debootstrapped Debian 12 and booted under a real systemd (nspawn).

Needs root; tests/systemd/make-rootfs installs debootstrap and systemd-nspawn and caches the
rootfs. As root a missing part is a failure; a run without root skips, saying why.

Debian 13 (trixie, systemd 257, Python 3.13) is a check run by hand, not in CI's run
(benchmarks/RESULTS.md has its last result):

    GPUWARDEN_ROOTFS_SUITE=trixie .venv/bin/python -m pytest -p no:xdist -q tests/test_systemd_deb.py -m systemd

GPUWARDEN_ROOTFS_SUITE picks the suite make-rootfs debootstraps (default bookworm) and the cache
/var/cache/gpuwarden-test/SUITE-rootfs; GPUWARDEN_ROOTFS points at another rootfs. One thing differs
there, in the rig: the vLLM venv (bind-mounted at its own path) is the host's, whose bin/python3 is
/usr/bin/python3, and in the container that is the container's own python3: Debian 12's 3.11 is the
venv's, Debian 13's 3.13 is not (and the CPU wheels of torch and vLLM here are for 3.11 only). Where
the rootfs lacks the venv's python3.X, vllm_binds() binds the host's interpreter, stdlib and headers
(inductor compiles against Python.h) read-only at the same paths and shadows the venv's bin/ with a
copy whose python3 is that interpreter. The daemon itself runs on the container's python3 and Debian's
packages. The container gets the cgroup hierarchy nspawn picks for the host (v1 on a host without a
unified one); SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 in the environment gives it cgroup v2, as a Debian 13
host has.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import CPU_TINY_PROFILE, ROOT

pytestmark = [pytest.mark.process, pytest.mark.systemd]
HERE = ROOT / "tests" / "systemd"
API_KEY = "sk-e2e-credential-5f1c"
SUITE = os.environ.get("GPUWARDEN_ROOTFS_SUITE", "bookworm")
ROOTFS_CACHE = Path(os.environ.get("GPUWARDEN_ROOTFS", f"/var/cache/gpuwarden-test/{SUITE}-rootfs"))


def require(condition, why):
    """As root (CI, or `bash tests/run` as the README says) a missing part is a failure: tests/systemd/make-rootfs
    installs nspawn and debootstrap. Only a run without root skips, saying why."""
    if not condition:
        if os.environ.get("CI") == "true" or os.geteuid() == 0:
            pytest.fail(f"as root: {why}")
        pytest.skip(why)


NEWER = "0.2.1-1"  # the version the upgrade test installs over the tree's own


@pytest.fixture(scope="module")
def deb():
    require(os.geteuid() == 0, "building and installing the .deb needs root")
    proc = subprocess.run([str(ROOT / "packaging" / "build-deb")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = (ROOT / "dist").glob("gpuwarden_*_all.deb")
    return path, proc.stdout


@pytest.fixture(scope="module")
def newer_deb(deb):
    """The same tree as a newer version: what an upgrade installs."""
    out = ROOT / "dist" / "newer"
    proc = subprocess.run([str(ROOT / "packaging" / "build-deb")], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, GPUWARDEN_DEB_VERSION=NEWER, GPUWARDEN_DEB_OUT=str(out)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob(f"gpuwarden_{NEWER}_all.deb")
    return path


def nspawn(root, *args, timeout=600, boot=False, binds=(), ro_binds=()):
    Path("/run/systemd/nspawn").mkdir(parents=True, exist_ok=True)
    cmd = ["systemd-nspawn", "-q", "-D", str(root), "--register=no", "--keep-unit",
           *[f"--bind={b}" for b in binds], *[f"--bind-ro={b}" for b in ro_binds], *(["-b"] if boot else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def installed_root(deb, tmp_path_factory):
    """A copy of the cached rootfs with the .deb installed by apt (dependencies from Debian)."""
    require(os.geteuid() == 0, "the nspawn boot needs root (tests/systemd/make-rootfs installs nspawn and debootstrap)")
    proc = subprocess.run(["bash", str(HERE / "make-rootfs"), str(ROOTFS_CACHE), SUITE], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    root = tmp_path_factory.mktemp("nspawn") / "root"
    subprocess.run(["cp", "-a", "--reflink=auto", str(ROOTFS_CACHE), str(root)], check=True)
    shutil.copy(deb[0], root / "var" / "cache" / "gpuwarden.deb")  # nspawn mounts its own /tmp
    # The test drop-in exists before the package does, as an admin's would: dpkg keeps it.
    (root / "etc" / "gpuwarden" / "conf.d").mkdir(parents=True)
    shutil.copy(HERE / "10-e2e.yaml", root / "etc" / "gpuwarden" / "conf.d" / "10-e2e.yaml")
    proc = nspawn(root, "/bin/sh", "-c", "apt-get update -qq && DEBIAN_FRONTEND=noninteractive "
                  "apt-get install -y -qq --no-install-recommends /var/cache/gpuwarden.deb man-db libnuma1")
    # man-db: verify checks the man page; libnuma1: vLLM's CPU build needs it (a GPU host's vLLM brings its own)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


def add_checks(root, script):
    # The fake child and its flag-check stand-in, for the broken-serving check.
    lib = root / "usr" / "local" / "lib" / "gpuwarden-e2e"
    lib.mkdir(parents=True, exist_ok=True)
    # The fake OpenAI server, for the tune checks (it serves at the simulated card's speed).
    for name, mode in (("fakechild.py", 0o644), ("fakechild-flagcheck", 0o755), ("fake_openai.py", 0o644)):
        shutil.copy(ROOT / "tests" / "harness" / name, lib / name)
        (lib / name).chmod(mode)
    shutil.copy(script, root / "usr" / "local" / "bin" / "gpuwarden-e2e")
    (root / "usr" / "local" / "bin" / "gpuwarden-e2e").chmod(0o755)
    unit = root / "etc" / "systemd" / "system" / "gpuwarden-e2e.service"
    shutil.copy(HERE / "gpuwarden-e2e.service", unit)
    wants = root / "etc" / "systemd" / "system" / "multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / "gpuwarden-e2e.service").symlink_to("/etc/systemd/system/gpuwarden-e2e.service")


def vllm_binds(root, venv, scratch):
    """What the container needs to run the host's vLLM venv: nothing where the rootfs has the venv's
    python3.X (Debian 12); else (Debian 13: 3.13) the host's interpreter, its stdlib and headers, and a
    copy of the venv's bin/ whose python3 is that interpreter, for nspawn's --bind-ro (mounted parents
    first, so the copy shadows the venv's bin/)."""
    cfg = dict(line.split(" = ", 1) for line in (venv / "pyvenv.cfg").read_text().splitlines() if " = " in line)
    name = "python" + ".".join(cfg["version"].split(".")[:2])  # python3.11
    if (root / "usr" / "bin" / name).exists():
        return []
    exe = Path(cfg["executable"])  # /usr/bin/python3.11
    parts = [exe, Path("/usr/lib") / name, Path("/usr/include") / name, *Path("/usr/include").glob(f"*/{name}")]
    for part in parts:
        assert part.exists(), f"{part}: the host's {name} (python3-dev) for the venv in a rootfs without it"
    shutil.copytree(venv / "bin", scratch, symlinks=True)
    (scratch / "python3").unlink()
    (scratch / "python3").symlink_to(exe)
    return [f"{part}:{part}" for part in parts] + [f"{scratch}:{venv / 'bin'}"]


def results(folder):
    text = (folder / "results.txt").read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_lintian_is_clean_and_warnings_are_justified(deb):
    tags = re.findall(r"^([EWIPX]): gpuwarden: ([a-z0-9-]+)", deb[1], re.M)
    assert not [t for level, t in tags if level == "E"], deb[1]
    readme = (ROOT / "packaging" / "README").read_text()
    for level, tag in tags:
        if level in "WI":
            assert tag in readme, f"lintian {level}: {tag} is not justified in packaging/README"


def test_package_contents(deb):
    listing = subprocess.run(["dpkg-deb", "-c", str(deb[0])], capture_output=True, text=True, check=True).stdout
    for path in ("./etc/gpuwarden/gpuwarden.yaml", "./lib/systemd/system/gpuwarden.service", "./usr/bin/gpuwarden",
                 "./usr/lib/sysusers.d/gpuwarden.conf", "./usr/share/gpuwarden/vendor/pynvml.py",
                 "./usr/share/gpuwarden/prometheus/gpuwarden-rules.yml", "./usr/share/man/man8/gpuwarden.8.gz",
                 "./usr/share/man/man5/gpuwarden.yaml.5.gz"):
        assert path in listing, path
    info = subprocess.run(["dpkg-deb", "-f", str(deb[0]), "Architecture", "Depends"], capture_output=True, text=True,
                          check=True).stdout
    assert "Architecture: all" in info and "python3-prometheus-client" in info and "sdnotify" not in info
    conffiles = subprocess.run(["dpkg-deb", "-I", str(deb[0]), "conffiles"], capture_output=True, text=True).stdout
    assert conffiles.split() == ["/etc/gpuwarden/gpuwarden.yaml"]


def test_boots_tunes_alerts_stops_fails_cleanly_and_survives_a_stall(installed_root, tmp_path):
    root = tmp_path / "root"
    subprocess.run(["cp", "-a", "--reflink=auto", str(installed_root), str(root)], check=True)
    add_checks(root, HERE / "e2e-checks")
    folder = tmp_path / "results"
    folder.mkdir()
    proc = nspawn(root, boot=True, binds=[f"{folder}:/results"], timeout=400)
    got = results(folder)
    assert got.get("done") == "yes", (proc.stdout[-3000:], got)
    assert got["active"] == "active"
    assert got["status_read_only"].startswith("2 GPUs · read-only · GPU0 ") and "sm_clock_low" in got[
        "status_read_only"] or "memory_clock_low" in got["status_read_only"]
    assert int(got["warnings_low_clock"]) == 2, got  # one firing line per busy GPU
    assert int(got["warnings_priority"]) >= 4 and int(got["warnings_chatty"]) == 0
    assert int(got["metrics_alert_firing"]) == 2
    assert (got["after_persistenced"], got["wants_persistenced"]) == ("1", "0"), got
    assert got["status_tuned"].startswith("2 GPUs · locked 3090 MHz"), (folder / "journal.txt").read_text()[-4000:]
    assert int(got["resolved_low_clock"]) == 2 and int(got["metrics_alert_clear"]) == 2
    assert int(got["metrics_tuning"]) == 2
    assert got["persistence_fallback"] == "1" and got["persistence_on"] == "2", got
    # tune: the sweep ran through the root-only socket; the configured 140 W back after it, after tune's SIGKILL,
    # and after the daemon's SIGKILL mid-sweep (restored by the restarted daemon, from the marker and originals)
    assert got["tune_exit"] == "0", (folder / "tune.err").read_text()[-2000:]
    tuned = json.loads((folder / "tune.json").read_text())
    assert [s["setting"] for s in tuned["steps"]] == [120, 100] and "knee" in tuned, json.dumps(tuned)[:4000]
    assert tuned["knee"]["setting"] in (120, 100), tuned
    assert got["tune_limit_after"] == "140.0" and got["tune_killed_limit"] == "140.0", got
    assert got["tune_socket"] == "600 root" and got["tune_nobody"] == "1", got
    assert got["tune_swept"] == "90.0" and got["tune_daemon_killed_limit"] == "140.0", got
    assert got["tune_restored_logged"] == "1", (folder / "journal.txt").read_text()[-3000:]
    # a stop, not a hang: the unit's TimeoutStopSec is 120 s (how soon is the box's business)
    assert float(got["stop_seconds"]) < 60 and got["stop_result"] == "success" and got["stop_status"] == "0"
    assert got["broken_state"] == "failed" and got["broken_status"] == "78" and got["broken_restarts"] == "0"
    assert got["broken_logged"] == "1"
    assert int(got["watchdog_restarts"]) >= 1 and got["watchdog_new_pid"] == "yes"
    assert int(got["watchdog_logged"]) >= 1 and got["watchdog_active"] == "active"
    # A broken serving side: vLLM FATAL, but the polls go on, so the watchdog is fed and nothing restarts.
    assert got["broken_serving_active"] == "active" and got["broken_serving_restarts"] == "0", got
    assert "vLLM FATAL" in got["broken_serving_status"] and got["broken_serving_fatal"] == "1", got
    assert float(got["broken_serving_age"]) < 10, got  # polled on: a stopped loop's snapshot would age past 25 s
    assert got["confdir_mode"] == "750" and got["nobody_reads_config"] == "no", got
    assert got["credential"] == "vllm.env" and got["credential_mode"] == "600 root", got
    verify = (folder / "verify.txt").read_text()
    assert got["verify_lines"] == "0", f"systemd-analyze verify printed:\n{verify}"
    assert got["security"].startswith("Overall exposure level for gpuwarden.service")
    assert float(got["security"].split(": ")[1].split()[0]) <= 3.0, got["security"]  # issue 51
    # Both man pages, as `man` finds and renders them (packaging/man/, generated by docs/gen/).
    assert got["man_status"] == "0" and int(got["man_tune"]) >= 1, (folder / "man8.err").read_text()
    assert got["man5_status"] == "0" and int(got["man5_nodes"]) >= 1, (folder / "man5.err").read_text()
    assert got["man_warnings"] == "0", (folder / "man8.err").read_text() + (folder / "man5.err").read_text()
    assert got["upgrade_handed_over"] == "yes", (folder / "journal.txt").read_text()[-3000:]
    assert got["removed_inactive"] in ("inactive", "unknown") and got["removed_config_kept"] == "yes"
    assert (got["purged_config"], got["purged_state"], got["purged_unit"]) == ("gone", "gone", "gone")


def test_serving_ready_only_when_vllm_is_healthy_and_stop_leaves_nothing(installed_root, tmp_path, vllm_python,
                                                                        tiny_model, newer_deb):
    root = tmp_path / "root"
    subprocess.run(["cp", "-a", "--reflink=auto", str(installed_root), str(root)], check=True)
    shutil.copy(newer_deb, root / "var" / "cache" / "gpuwarden-new.deb")
    add_checks(root, HERE / "e2e-vllm-checks")
    conf = root / "etc" / "gpuwarden" / "conf.d"
    (conf / "10-e2e.yaml").unlink()
    (conf / "10-e2e-vllm.yaml").write_text((HERE / "10-e2e-vllm.yaml").read_text()
                                           .replace("VLLM_PYTHON", str(vllm_python)))
    (root / "etc" / "gpuwarden" / "profiles.d" / "cpu-tiny.yaml").write_text(CPU_TINY_PROFILE.read_text())
    # vLLM's API key goes only where the package says: the root-only credential file.
    (root / "etc" / "gpuwarden" / "credentials" / "vllm.env").write_text(f"VLLM_API_KEY={API_KEY}\n")
    folder = tmp_path / "results"
    folder.mkdir()
    venv = vllm_python.parent.parent
    proc = nspawn(root, boot=True, timeout=1200,
                  binds=[f"{folder}:/results", f"{venv}:{venv}", f"{tiny_model}:/srv/tiny-model"],
                  ro_binds=vllm_binds(root, venv, tmp_path / "venv-bin"))
    got = results(folder)
    full = (folder / "journal.txt").read_text() if (folder / "journal.txt").exists() else proc.stdout[-3000:]
    # For the messages: what systemd said of the unit (a restart, a watchdog, an exit) first, then the tail.
    journal = "\n".join(line for line in full.splitlines() if "gpuwarden.service:" in line)[-3000:] + \
        "\n...\n" + full[-4000:]
    assert got.get("done") == "yes", journal
    assert got["state"] == "active" and got["health"] == "200", journal
    assert int(got["vllm_processes"]) >= 2, "the API server and its engine run as the gpuwarden user"
    assert got["completion"] == "1" and got["completion_without_key"] == "401"  # vLLM got the key, and uses it
    assert int(got["key_in_child_env"]) >= 1
    assert got["key_in_journal"] == "0" and got["key_in_status"] == "0"
    assert "tiny-model (cpu-tiny)" in got["status"]
    # READY=1 (systemd's "Started") came only after vLLM answered /health.
    lines = full.splitlines()
    healthy = next(i for i, line in enumerate(lines) if "vLLM healthy after" in line)
    started = next(i for i, line in enumerate(lines) if "Started gpuwarden.service" in line)
    assert healthy < started
    # The proxy beside it: supervised as the same user, the key passed through, back after a SIGKILL while the
    # engine and the daemon go on.
    assert got["proxy_health"] == "200" and got["proxy_user"] == "gpuwarden", journal
    assert got["proxy_completion"] == "1" and got["proxy_completion_without_key"] == "401"
    assert got["proxy_state"] == "1"
    # joules per request under the unit's UMask=0077 (the re-check's N1: a 0700 folder, and no joules, silently)
    assert got["energy_folder_mode"] == "755" and got["proxy_joules_count"] == "1.0", journal
    assert got["proxy_back"] == "200" and got["proxy_restart_logged"] == "1", journal
    assert got["state_after_proxy_kill"] == "active" and got["health_after_proxy_kill"] == "200"
    # An upgrade under a steady stream (direct and through the proxy): the same engine, proxy and daemon
    # processes, the new version, no failed request.
    assert got["upgrade_version"] == NEWER.split("-")[0], journal
    assert (got["upgrade_engine_same"], got["upgrade_proxy_same"], got["upgrade_daemon_same"]) == \
        ("yes", "yes", "yes"), journal
    stream = json.loads(got["upgrade_stream"])
    assert stream["ok"] >= 10 and stream["failed"] == 0, stream
    assert got["upgrade_adopted_logged"] == "2", journal  # the engine and the proxy, one line each
    # systemctl restart of the upgraded daemon: it stopped the engine it adopted and the next daemon started a new
    # one; systemd's store kept the proxy's socket through it (a job was queued), the new daemon's proxy serves on
    # it, and a local user's bind loop never held the port meanwhile (before: the stop let it go).
    assert got["restart_state"] == "active" and got["restart_engine_new"] == "yes", journal
    assert got["restart_proxy_new"] == "yes", journal
    assert got["restart_proxy_health"] == "200" and got["restart_proxy_completion"] == "1", journal
    assert got["restart_squatter_held"] == "0", journal
    # SIGKILL of the daemon alone: systemd restarts it, it adopts the engine; no request fails.
    assert got["crash_new_daemon"] == "yes" and got["crash_same_engine"] == "yes", journal
    stream = json.loads(got["crash_stream"])
    assert stream["ok"] >= 10 and stream["failed"] == 0, stream
    assert got["crash_adopted_logged"] == "1" and got["crash_metrics"] == "yes", journal
    # systemctl stop with a request in flight straight to the engine and one through the proxy: both complete,
    # every token, within the engine's drain; the proxy stops after the engine. 3,000 tokens each: two of 12,000
    # outlasted the 60 s drain when the box served 170-350 tokens/s (ci46).
    for where in ("direct", "proxy"):
        assert json.loads(got[f"stop_long_{where}"]) == {"status": 200, "tokens": 3000}, (where, journal)
    assert got["stop_in_flight"] == "2", journal
    # Both streamed their first tokens before the stop (stop_in_flight), so both were in flight at it; the drain
    # line's count is the daemon's last /metrics read, which may come before they started.
    # two drains in the boot: the restart's stop of the adopted engine above (nothing in flight), then this one
    assert got["stop_drained_logged"] == "2" and got["stop_draining_line"].startswith("draining vLLM: ") and \
        got["stop_draining_line"].endswith("up to 60 s"), journal
    assert full.index("vLLM drained in") < full.index("the proxy stopping"), journal
    assert got["stop_result"] == "success" and got["leftover"] == "0"
    assert int(got["stop_squatter_held"]) >= 1, got  # the control: after a stop the same bind loop holds the port
