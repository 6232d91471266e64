"""Least privilege: no code from vLLM's install runs as root or with a capability, and secrets stay secret.

A planted `vllm` package, in a venv owned by the serving user (as people install it), records the uid,
the effective capabilities and no_new_privs of every process that imports it: the flag check of `run`,
`check --deep`, `doctor`, and the child itself. Needs root (to switch users), as CI has.
"""

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, gpuwarden_cmd, subprocess_env, users_locked

SECRET = "sk-planted-0123456789"

RECORD = '''
import os, sys
def _field(name):
    for line in open("/proc/self/status"):
        if line.startswith(name + ":"):
            return line.split()[1]
with open(os.environ["PLANT_LOG"], "a") as _log:
    _log.write(f"{WHO} uid={os.getuid()} euid={os.geteuid()} caps={_field('CapEff')} "
               f"nnp={_field('NoNewPrivs')}\\n")
'''
PARSER = '''
import argparse
def make_arg_parser(parser):
    for flag in ("--model", "--host", "--port", "--gpu-memory-utilization", "--max-model-len"):
        parser.add_argument(flag)
    return parser
def validate_parsed_serve_args(args):
    pass
'''
SERVER = '''
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"vllm:num_requests_running 0\\n" if self.path == "/metrics" else b""
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
args = sys.argv
port = int(args[args.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture(scope="module")
def planted(child_user):
    """A venv owned by the serving user whose `vllm` package records who imports it."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("under CI=true these tests need root")
        pytest.skip("switching to the serving user needs root")
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-planted-"))
    folder.chmod(0o755)
    venv = folder / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    files = {
        "vllm/__init__.py": "WHO = 'import'\n" + RECORD + "__version__ = '0.0.0+planted'\n",
        "vllm/entrypoints/__init__.py": "",
        "vllm/entrypoints/launchers/__init__.py": "",
        "vllm/entrypoints/launchers/cli_args.py": PARSER,
        "vllm/utils/__init__.py": "",
        "vllm/utils/argparse_utils.py": "from argparse import ArgumentParser as FlexibleArgumentParser\n",
        "vllm/entrypoints/openai/__init__.py": "",
        "vllm/entrypoints/openai/api_server.py": "WHO = 'child'\n" + RECORD + SERVER,
    }
    for name, text in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    user = pwd.getpwnam(child_user)
    for path in [venv, *venv.rglob("*")]:
        os.lchown(path, user.pw_uid, user.pw_gid)  # the serving user could plant anything here
    log_dir = folder / "log"
    log_dir.mkdir(mode=0o777)
    log_dir.chmod(0o777)
    yield {"python": venv / "bin" / "python", "log": log_dir / "plant.log", "user": child_user, "folder": folder}
    shutil.rmtree(folder, ignore_errors=True)


def config(write, planted, extra=""):
    metrics = free_port()
    secrets = write("vllm.env", f"# the API key vLLM requires\nVLLM_API_KEY={SECRET}\n")
    secrets.chmod(0o600)
    path = write("gpuwarden.yaml", f"""poll_interval_s: 0.25
metrics:
  listen: 127.0.0.1:{metrics}
gpu:
  backend: sim
  scenario: dgx-spark
serve:
  enabled: true
  profile: generic
  model: /planted/model
  command: [{planted["python"]}, -m, vllm.entrypoints.openai.api_server]
  user: {planted["user"]}
  port: {free_port()}
  env: {{PLANT_LOG: "{planted["log"]}"}}
  env_file: {secrets}
  startup_timeout_s: 30
{extra}""")
    return path, f"http://127.0.0.1:{metrics}"


def records(planted):
    return planted["log"].read_text().splitlines() if planted["log"].exists() else []


def assert_unprivileged(lines, uid):
    assert lines
    for line in lines:
        fields = dict(f.split("=") for f in line.split()[1:])
        assert fields == {"uid": str(uid), "euid": str(uid), "caps": "0000000000000000", "nnp": "1"}, line


@pytest.mark.process
@pytest.mark.parametrize("command", [["check", "--deep"], ["doctor"]])
def test_checks_run_vllms_code_as_the_serving_user_without_capabilities(write, planted, command):
    planted["log"].unlink(missing_ok=True)
    path, _ = config(write, planted)
    proc = subprocess.run(gpuwarden_cmd() + [*command, "-c", str(path)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert "vLLM 0.0.0+planted accepts" in proc.stdout, proc.stdout + proc.stderr
    lines = records(planted)
    assert [line.split()[0] for line in lines] == ["import"]
    assert_unprivileged(lines, pwd.getpwnam(planted["user"]).pw_uid)
    assert SECRET not in proc.stdout + proc.stderr


@pytest.mark.process
def test_run_starts_the_flag_check_and_the_child_unprivileged_with_only_the_allowed_environment(write, planted,
                                                                                              daemons, tmp_path):
    planted["log"].unlink(missing_ok=True)
    path, base = config(write, planted)
    creds = tmp_path / "creds"
    creds.mkdir()
    env = dict(subprocess_env(), CREDENTIALS_DIRECTORY=str(creds), INVOCATION_ID="0123abcd", MY_DB_PASSWORD="x",
               PATH="/root/bin:" + os.environ.get("PATH", ""), LANG="C.UTF-8", LC_ALL="C.UTF-8", NCCL_DEBUG="WARN")
    env.pop("LANGUAGE", None)
    env.pop("TZ", None)
    d = daemons(path, env=env)
    d.wait_for("vLLM healthy after", timeout=60)
    lines = records(planted)
    assert sorted(line.split()[0] for line in lines) == ["child", "import", "import"]  # flag check, child
    uid = pwd.getpwnam(planted["user"]).pw_uid
    assert_unprivileged(lines, uid)
    state = json.loads(urllib.request.urlopen(base + "/status", timeout=5).read())
    pid = state["serving"]["pid"]
    child_env = dict(item.split("=", 1) for item in
                     Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if item)
    home = pwd.getpwnam(planted["user"]).pw_dir
    assert child_env == {
        "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "NCCL_DEBUG": "WARN",  # the locale, the CUDA and NCCL variables
        "PATH": f"{planted['python'].parent}:/usr/local/bin:/usr/bin:/bin",  # made for the child
        "HOME": home, "USER": planted["user"], "LOGNAME": planted["user"],
        "PLANT_LOG": str(planted["log"]),  # serve.env
        "VLLM_API_KEY": SECRET,  # serve.env_file
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0",
    }
    profiles = subprocess.run(gpuwarden_cmd() + ["profiles", "show", "-c", str(path)], capture_output=True,
                              text=True, env=subprocess_env(), timeout=60)
    assert profiles.returncode == 0
    assert d.stop() == 0
    assert SECRET not in d.log and SECRET not in json.dumps(state) and SECRET not in profiles.stdout


@pytest.mark.process
def test_secrets_in_a_file_others_can_read_are_refused(write, planted):
    path, _ = config(write, planted)
    secrets = path.parent / "vllm.env"
    secrets.chmod(0o644)
    proc = subprocess.run(gpuwarden_cmd() + ["run", "-c", str(path)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60)
    assert proc.returncode == 78
    assert proc.stderr.strip() == (f"{secrets}:1: (secrets): mode 0644 lets others read it: chmod 600 {secrets} "
                                   f"(named by {path}: serve.env_file)")
    assert SECRET not in proc.stderr


@pytest.mark.process
@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_an_env_file_that_is_a_directory_or_a_link_is_one_line_in_words(write, planted, kind):
    """A directory gave an IsADirectoryError traceback, exit 1 and a leaked fd; a link "Too many levels of
    symbolic links". Each is now one FILE:LINE line that says what is wrong, with exit 78."""
    path, _ = config(write, planted)
    secrets = path.parent / "vllm.env"
    if kind == "directory":
        secrets.unlink()
        secrets.mkdir(mode=0o700)
        says = "is a directory, not a regular file"
    else:
        real = secrets.rename(path.parent / "real.env")
        secrets.symlink_to(real)
        says = "is a symbolic link: name the file itself"
    proc = subprocess.run(gpuwarden_cmd() + ["check", "-c", str(path)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60)
    assert proc.returncode == 78, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"{secrets}:1: (secrets): {says}") and line.endswith(f"(named by {path}: serve.env_file)")


def test_reading_a_directory_as_an_env_file_leaks_no_descriptor(tmp_path):
    from gpuwarden.serving.compose.secrets import SecretFileError, read_env_file

    folder = tmp_path / "d"
    folder.mkdir(mode=0o700)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(SecretFileError, match="is a directory"):
            read_env_file(folder, owner=os.geteuid())
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.process
@pytest.mark.parametrize("kind", ["uid-0 alias", "member of sudo"])
def test_serve_user_that_is_root_by_another_name_is_refused(write, planted, kind):
    name = "gw-toor-test" if kind == "uid-0 alias" else "gw-sudoer-test"
    add = ["useradd", "-o", "-u", "0", "-g", "0", "-M", "-s", "/usr/sbin/nologin", name] if kind == "uid-0 alias" \
        else ["useradd", "-M", "-s", "/usr/sbin/nologin", "-G", "sudo", name]
    with users_locked():
        if kind == "member of sudo":
            subprocess.run(["groupadd", "-f", "sudo"], check=True)
        subprocess.run(["userdel", "-f", name], capture_output=True)  # a leftover of an interrupted run
        subprocess.run(add, check=True)
    try:
        path, _ = config(write, planted)
        path.write_text(path.read_text().replace(f"user: {planted['user']}", f"user: {name}"))
        proc = subprocess.run(gpuwarden_cmd() + ["run", "-c", str(path)], capture_output=True, text=True,
                              env=subprocess_env(), timeout=60)
        assert proc.returncode == 78
        (line,) = proc.stderr.strip().splitlines()
        says = "has uid 0: it is root by another name" if kind == "uid-0 alias" else "is in group sudo, which grants root"
        assert line.startswith(f"{path}:") and f"serve.user: user {name} {says}" in line, line
        assert not records(planted) or "vLLM starting" not in proc.stderr
    finally:
        with users_locked():  # -f: a uid-0 account is "in use" by every root process
            subprocess.run(["userdel", "-f", name], capture_output=True)
