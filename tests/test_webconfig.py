"""TLS and basic auth on /metrics and /status, from a node_exporter-style web config file, on a real daemon."""

import json
import ssl
import subprocess
import urllib.error
import urllib.request

import bcrypt
import pytest

from conftest import free_port, gpuwarden_cmd, subprocess_env
from gpuwarden.webconfig import basic_auth_header

pytestmark = pytest.mark.integration


@pytest.fixture
def secured(write, tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-keyout", str(tmp_path / "server.key"), "-out", str(tmp_path / "server.crt")],
                   check=True, capture_output=True, timeout=60)
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    write("web.yml", f"tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
                     f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    port = free_port()
    path = write("gpuwarden.yaml", f"poll_interval_s: 0.5\ntuning:\n  apply: false\n"
                                   f"metrics:\n  listen: 127.0.0.1:{port}\n  web_config: web.yml\n")
    context = ssl.create_default_context(cafile=str(tmp_path / "server.crt"))
    context.check_hostname = False
    return path, f"https://127.0.0.1:{port}", context


def get(url, context, auth=None):
    headers = {"Authorization": basic_auth_header(*auth)} if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_tls_and_basic_auth_guard_metrics_and_status(secured, daemons, cli):
    path, base, context = secured
    d = daemons(path, "--sim", "rtx-pro-4000-headless")
    d.wait_for("serving /metrics and /status on https://")
    assert get(base + "/metrics", context)[0] == 401
    assert get(base + "/metrics", context, ("prometheus", "wrong"))[0] == 401
    assert get(base + "/metrics", context, ("nobody", "s3cret"))[0] == 401
    code, text = get(base + "/metrics", context, ("prometheus", "s3cret"))
    assert code == 200 and "gpuwarden_gpu_up" in text
    code, text = get(base + "/status", context, ("prometheus", "s3cret"))
    assert code == 200 and json.loads(text)["daemon"]["pid"] == d.proc.pid
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(base.replace("https", "http") + "/metrics", timeout=5).read()  # no plain HTTP
    status, out, err = cli("status", "-c", path)
    assert status == 3 and "wants basic auth (metrics.web_config): give --user NAME" in err
    env = subprocess_env() | {"GPUWARDEN_PASSWORD": "s3cret"}
    proc = subprocess.run(gpuwarden_cmd() + ["status", "-c", str(path), "--user", "prometheus"], capture_output=True,
                          text=True, env=env, timeout=30)
    assert proc.returncode == 0 and "2 GPUs · read-only" in proc.stdout
    assert d.stop() == 0 and "Traceback" not in d.log


def test_a_bad_web_config_is_a_located_error(write, cli):
    write("web.yml", "tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n"
                     "basic_auth_users:\n  prometheus: plaintext\n")
    path = write("gpuwarden.yaml", "metrics:\n  web_config: web.yml\n")
    status, _, err = cli("check", "-c", path)
    web = path.parent / "web.yml"
    assert status == 78
    assert err.splitlines() == [
        f"{web}:2: tls_server_config.cert_file: {path.parent / 'missing.crt'} is not a readable file",
        f"{web}:3: tls_server_config.key_file: {path.parent / 'missing.key'} is not a readable file",
        f"{web}:5: basic_auth_users.prometheus: expected a bcrypt hash ($2b$...) "
        "(make one with: htpasswd -nBC 12 \"\" | tr -d ':\\n')"]
