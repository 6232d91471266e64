"""Real podman for the container engine's tests (tests/test_container_podman.py): Debian 12's podman 4.3.1 with runc
(crun fails on this machine on setrlimit and the hybrid cgroup mount) and a containers.conf of the tests' own with
`default_ulimits = []`; its API (Docker's and libpod's) served by `podman system service` on a socket of the tests'
own, as `podman.socket` serves /run/podman/podman.sock on a host; a local image imported from the Debian 12 rootfs
the nspawn tests build (tests/systemd/make-rootfs), no registry, with the host's libnuma (vLLM's CPU build needs it;
the nspawn test installs Debian's libnuma1 into its copy of the rootfs). The fake engine (tests/harness/fakechild.py, which
needs only the standard library) is mounted into each container, and a vLLM 0.32.0 dist-info beside it, so that the
image's installed-versions probe hears the version the drain flag needs, with a stand-in of vLLM's serve parser for
the engine's flag check in the image."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/gpuwarden-test-bookworm:2"  # :2 has libnuma
ROOTFS = Path("/var/cache/gpuwarden-test/bookworm-rootfs")
CONTAINERS_CONF = '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n'
INSTALL = "apt install podman runc python3-docker (tests/run installs them)"


class PodmanUnavailable(Exception):
    pass


class Podman:
    """`podman system service` on folder/podman.sock, started and stopped by its own process group."""

    def __init__(self, folder: Path):
        for tool in ("podman", "runc"):
            if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
                raise PodmanUnavailable(f"{tool} is missing: {INSTALL}")
        conf = folder / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        self.socket = folder / "podman.sock"
        self.log = folder / "podman.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
                                         env=self.env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 60
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise PodmanUnavailable(f"podman system service did not listen: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        import docker

        self.api = docker.APIClient(base_url=f"unix://{self.socket}", version="auto", timeout=60)

    def cli(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True, timeout=600, **kwargs)

    def image(self) -> str:
        """The tests' image, imported once from the nspawn tests' rootfs (built if missing)."""
        if self.cli("image", "exists", IMAGE).returncode == 0:
            return IMAGE
        if not (ROOTFS / "usr" / "bin" / "python3").exists():
            subprocess.run(["bash", str(ROOT / "tests" / "systemd" / "make-rootfs")], check=True, timeout=1800)
        numa = sorted(p.relative_to("/") for p in Path("/usr/lib/x86_64-linux-gnu").glob("libnuma.so.1*"))
        if not numa:
            raise PodmanUnavailable("the host has no libnuma.so.1 for the image (apt install libnuma1)")
        with tempfile.TemporaryDirectory() as scratch:
            tar = Path(scratch) / "rootfs.tar"
            subprocess.run(["tar", "-C", str(ROOTFS), "-cf", str(tar), "."], check=True, timeout=600)
            subprocess.run(["tar", "-C", "/", "-rf", str(tar), *map(str, numa)], check=True, timeout=60)
            done = self.cli("import", str(tar), IMAGE)
        if done.returncode != 0:
            raise PodmanUnavailable(f"podman import failed: {done.stderr[-2000:]}")
        return IMAGE

    def derived(self, folder: Path, label: str) -> str:
        """The ID of an image built FROM the tests' image with one more label: another image, no layer of its own
        (no container runs to build it)."""
        (folder / "Containerfile").write_text(f"FROM {self.image()}\nLABEL {label}\n")
        done = self.cli("build", "--pull=never", "-q", "-f", str(folder / "Containerfile"), str(folder))
        if done.returncode != 0:
            raise PodmanUnavailable(f"podman build failed: {done.stderr[-2000:]}")
        found = self.api.inspect_image(done.stdout.strip().splitlines()[-1])["Id"]
        return found if found.startswith("sha256:") else f"sha256:{found}"

    def labelled(self, label: str, value: str) -> list[dict]:
        """The containers with that label, running or not, as the runtime lists them."""
        return [c for c in self.api.containers(all=True, filters={"label": [f"{label}={value}"]})
                if (c.get("Labels") or {}).get(label) == value]

    def pid_of(self, cid: str) -> int:
        """The host PID of the container's first process."""
        return int(self.api.inspect_container(cid)["State"]["Pid"])

    def remove_labelled(self, label: str, value: str) -> None:
        for c in self.labelled(label, value):
            self.api.remove_container(c["Id"], force=True)

    def stop(self) -> None:
        self.api.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


FAKE_PARSER = """import argparse


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):
        refused = [a for a in args or [] if a.startswith("--no-such-")]
        if refused:
            self.error("unrecognized arguments: " + " ".join(refused))
        return argparse.Namespace(args=args)
"""
FAKE_CLI_ARGS = "def make_arg_parser(parser):\n    return parser\n\n\ndef validate_parsed_serve_args(args):\n    pass\n"


def fake_vllm_dist(folder: Path) -> Path:
    """A folder holding vLLM 0.32.0's dist-info and a stand-in of its serve parser, nothing else: on PYTHONPATH
    inside the container, importlib.metadata finds that version (the image's installed-versions probe), and the
    engine's flag check, run in the image, finds the modules vLLM 0.32's parser is in. The stand-in accepts the flags
    the fake engine does (tests/harness/fakechild-flagcheck): any, but one that starts with --no-such-, which it
    refuses as argparse does."""
    root = folder / "fakevllm"
    info = root / "vllm-0.32.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    (info / "top_level.txt").write_text("vllm\n")
    files = {"vllm/__init__.py": '__version__ = "0.32.0"\n', "vllm/entrypoints/__init__.py": "",
             "vllm/entrypoints/launchers/__init__.py": "", "vllm/entrypoints/launchers/cli_args.py": FAKE_CLI_ARGS,
             "vllm/utils/__init__.py": "", "vllm/utils/argparse_utils.py": FAKE_PARSER}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root
