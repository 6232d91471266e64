"""The engine from a container image, as data (issue 53): serve.container's keys, the container a composed engine
becomes (serving/compose/container.py), the create request of each runtime (podman's libpod, Docker's
create_container: their differences), and the engine's spec with the shim as its child (serving/run/containers.py).
No runtime here: tests/test_container_podman.py runs them on real podman."""

import json
import os
import signal
import sys

import pytest

from gpuwarden import config as configmod
from gpuwarden.base.yamlfile import ConfigErrors
from gpuwarden.config import ContainerConfig, Mount, ServeConfig
from gpuwarden.serving.compose.container import (LABEL_CHILD, LABEL_HOST, LABEL_OWNER, ContainerLaunch,
                                                 docker_create, inside_env, launch_of, libpod_body)
from gpuwarden.serving.compose.identity import Identity
from gpuwarden.serving.run.containers import ContainerPolicy, container_spec, launch_in, shim_argv
from gpuwarden.serving.run.spec import Timing, engine_spec


def parse(text):
    return configmod.parse_text(text)


def test_serve_container_reads_its_keys_with_defaults_and_says_each_bad_one_in_a_line():
    c = parse("serve:\n  container:\n    image: localhost/vllm-cpu:v0.32\n    mounts: [/srv/a:/a, '/srv/b:/b:rw']\n"
              ).serve.container
    assert c == ContainerConfig("localhost/vllm-cpu:v0.32", "podman", "/run/podman/podman.sock", (Mount("/srv/a", "/a", True),
                                                                          Mount("/srv/b", "/b", False)), False)
    assert c.api_socket == "/run/podman/podman.sock"
    assert parse("serve:\n  container: {image: x, runtime: docker}\n").serve.container.api_socket == "/run/docker.sock"
    assert parse("serve: {}\n").serve.container is None
    with pytest.raises(ConfigErrors) as bad:
        parse("serve:\n  container:\n    image: '-x y'\n    runtime: lxc\n    socket: run/p.sock\n"
              "    mounts: [a:/b, '/x:/y:zz', '/../x:/y', '/a:/c', '/b:/c', '/a,b:/d']\n    pulls: 1\n")
    said = [str(e) for e in bad.value.errors]
    for part in ("serve.container.image: not an image reference: '-x y'", "serve.container.runtime: 'lxc'",
                 "serve.container.socket: not an absolute path", "serve.container.mounts.0: 'a' is not an absolute",
                 "serve.container.mounts.1: not HOST:CONTAINER[:ro|:rw]", "serve.container.mounts.2: '/../x'",
                 "serve.container.mounts.4: /c is mounted twice", "serve.container.mounts.5: '/a,b'",
                 "serve.container.pulls: unknown key"):
        assert any(part in line for line in said), (part, said)
    assert len(said) == 9 and all("\n" not in line for line in said)
    with pytest.raises(ConfigErrors) as missing:
        parse("serve:\n  container: {runtime: podman}\n")
    assert "serve.container: missing required key 'image'" in str(missing.value)


def test_the_effective_config_writes_the_container_back_as_it_reads_it():
    config = parse("serve:\n  container:\n    image: localhost/e:1\n    mounts: [/m:/m]\n    pull: true\n")
    written = configmod.Config.as_dict(config)["serve"]["container"]
    assert written == {"image": "localhost/e:1", "runtime": "podman", "socket": "/run/podman/podman.sock",
                       "pull": True, "mounts": ["/m:/m:ro"], "shm_gib": 16}
    import yaml
    assert parse(yaml.safe_dump({"serve": {"container": written}})).serve.container == config.serve.container


def launch(tmp_path, gpus=("0", "1"), **changes):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    container = ContainerConfig("localhost/vllm-cpu:v0.32", changes.pop("runtime", "podman"), "",
                                (Mount("/srv/hf", "/hf", True), Mount("/srv/out", "/out", False)))
    env = {"VLLM_API_KEY": "secret-key", "PATH": "/opt/venv/bin:/usr/bin", "CUDA_VISIBLE_DEVICES": "2,3",
           "HF_HOME": "/hf"}
    return launch_of(container, "vllm", 8000, ("vllm", "serve", "--model", str(model)), inside_env(env), 999, 995,
                     (44, 105), str(model), gpus, 70, machine="abc123", owner="/var/lib/gpuwarden")


def test_a_launch_names_its_container_labels_it_mounts_the_model_read_only_and_carries_no_secret(tmp_path):
    one = launch(tmp_path)
    assert one.name == "gpuwarden-vllm-8000" and one.user == "999:995" and one.stop_timeout_s == 70
    assert dict(one.labels) == {LABEL_HOST: "abc123", LABEL_CHILD: "vllm", LABEL_OWNER: "/var/lib/gpuwarden"}
    model = str(tmp_path / "model")
    assert one.mounts[-1] == Mount(model, model, True)  # the model's folder, read-only, at its own path
    # the names only: the values (the API key) never reach the shim's argv
    assert one.env_names == ("HF_HOME", "HOME", "VLLM_API_KEY") and "secret-key" not in one.to_json()
    assert ContainerLaunch.from_json(one.to_json()) == one
    for bad in ("{}", "[]", json.dumps({**json.loads(one.to_json()), "extra": 1}), "not json"):
        with pytest.raises(ValueError):
            ContainerLaunch.from_json(bad)


def test_the_engines_environment_inside_has_no_host_path_nor_host_gpu_numbers_and_a_home():
    inside = inside_env({"PATH": "/x", "CUDA_VISIBLE_DEVICES": "3", "USER": "u", "LOGNAME": "u", "A": "1"})
    assert inside == {"A": "1", "HOME": "/tmp"}
    assert inside_env({"HOME": "/home/me"})["HOME"] == "/home/me"


def test_a_home_the_daemon_made_on_this_host_is_the_containers_tmp_inside(tmp_path, monkeypatch):
    """Attacker 19's F4: a serve.user without a writable home gets one under the state directory (homes.child_home),
    HOME and the caches there; the container has no such folder, and under /var/lib its user cannot make one. Inside,
    they are the container's /tmp's; a cache the config points elsewhere (a mount) stays."""
    from gpuwarden.serving.compose.homes import CACHES

    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))
    home = tmp_path / "home" / "vllm"
    made = {"HOME": str(home), **{name: str(home / sub) for name, sub in CACHES.items()}}
    inside = inside_env({**made, "HF_HOME": "/hf", "A": "1"})
    assert inside == {"HOME": "/tmp", "XDG_CACHE_HOME": "/tmp/.cache", "VLLM_CACHE_ROOT": "/tmp/.cache/vllm",
                      "HF_HOME": "/hf", "TRITON_CACHE_DIR": "/tmp/.cache/triton",
                      "TORCHINDUCTOR_CACHE_DIR": "/tmp/.cache/torchinductor", "A": "1"}
    assert not any(str(tmp_path) in value for value in inside.values())


def test_podman_gets_the_libpod_body_with_cdi_gpus_and_every_privilege_dropped(tmp_path):
    one = launch(tmp_path)
    body = libpod_body(one, {"VLLM_API_KEY": "k"})
    assert body["entrypoint"] == ["vllm"] and body["command"][:1] == ["serve"]  # not the image's own entrypoint
    assert body["user"] == "999:995" and body["groups"] == ["44", "105"]
    assert body["cap_drop"] == ["ALL"] and body["no_new_privileges"] is True and body["privileged"] is False
    assert body["netns"] == {"nsmode": "host"} and body["env"] == {"VLLM_API_KEY": "k"}
    assert body["devices"] == [{"path": "nvidia.com/gpu=0"}, {"path": "nvidia.com/gpu=1"}]
    assert body["stop_timeout"] == 70 and body["stop_signal"] == int(signal.SIGTERM)  # an integer in libpod
    # followable (journald's is not, on 4.3.1), and its file capped: an engine that floods filled root's disk through it
    assert body["log_configuration"] == {"driver": "k8s-file", "size": 64 << 20}
    assert body["shm_size"] == 16 << 30  # the runtimes' 64 MiB breaks NCCL between the GPUs of one container
    # bind, not rbind: a file system mounted below a read-only mount's source was writable through it (attacker 12)
    assert {"destination": "/hf", "source": "/srv/hf", "type": "bind", "options": ["bind", "ro"]} in body["mounts"]
    assert {"destination": "/out", "source": "/srv/out", "type": "bind", "options": ["bind", "rw"]} in body["mounts"]
    assert libpod_body(launch(tmp_path, gpus=()), {})["devices"] == []  # the simulator: no GPU to give


def test_docker_gets_a_device_request_and_the_same_privileges_dropped(tmp_path):
    """Docker's differences: GPUs as a DeviceRequest (its --gpus; podman 4.3.1's compat create drops those, so
    podman never gets this body), the stop signal by name, binds as strings, json-file logs."""
    kwargs = docker_create(launch(tmp_path, runtime="docker"), {"K": "v"})
    host = kwargs["host_config"]
    assert host["device_requests"] == [{"driver": "", "count": 0, "device_ids": ["0", "1"],
                                        "capabilities": [["gpu"]], "options": {}}]
    assert host["cap_drop"] == ["ALL"] and host["security_opt"] == ["no-new-privileges"]
    assert host["network_mode"] == "host" and host["privileged"] is False and host["group_add"] == ["44", "105"]
    assert "/srv/hf:/hf:ro" in host["binds"] and "/srv/out:/out:rw" in host["binds"]
    assert host["log_config"] == {"type": "json-file", "config": {"max-size": str(64 << 20), "max-file": "1"}}
    assert host["auto_remove"] is False and host["shm_size"] == 16 << 30
    assert kwargs["stop_signal"] == "SIGTERM" and kwargs["stop_timeout"] == 70
    assert kwargs["use_config_proxy"] is False and kwargs["environment"] == {"K": "v"}
    assert "device_requests" not in docker_create(launch(tmp_path, gpus=(), runtime="docker"), {})["host_config"]
    docker = pytest.importorskip("docker")  # docker-py itself takes these keywords
    client = docker.APIClient(base_url="unix:///nonexistent.sock", version="1.41")
    built = client.create_host_config(**host)
    assert built["DeviceRequests"][0]["DeviceIDs"] == ["0", "1"] and built["CapDrop"] == ["ALL"]


def me():
    return Identity("serve", 999, 995, "/home/serve", (44,), switch=True)


def test_the_container_engines_child_is_the_shim_run_as_root_without_capabilities_and_its_port_is_serve_users(
        tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/opt/gpuwarden")
    serve = ServeConfig(enabled=True, model=str(tmp_path), port=8123, drain_s=30, stop_timeout_s=20,
                        container=ContainerConfig("localhost/e:1"))
    from test_drain import composed

    command = composed(vllm="0.32.0").command
    plain = engine_spec(serve, command, me(), [])
    spec = container_spec(plain, serve.container, simulated=True, port=8123)
    found = launch_in(spec.argv)
    assert spec.argv == shim_argv(found) and spec.argv[0] == sys.executable
    assert found.argv == plain.argv and found.gpus == () and found.user == "999:995"
    assert found.stop_timeout_s == plain.drain_s + 10  # the drain and its margin, then the runtime's SIGKILL
    assert spec.timing.stop_timeout_s >= found.stop_timeout_s + 15  # the shim's own SIGKILL only after that
    assert spec.identity == me() and spec.launcher.uid == os.geteuid() and spec.launcher.drop_caps
    assert spec.runs_as is spec.launcher and spec.policy is ContainerPolicy
    # the shim's own PATH and PYTHONPATH; the engine's environment behind a prefix, never the shim's
    assert spec.env["PATH"] == "/usr/local/bin:/usr/bin:/bin" and spec.env["PYTHONPATH"] == "/opt/gpuwarden"
    assert {f"GPUWARDEN_ENGINE_ENV_{name}" for name in found.env_names} <= set(spec.env)
    assert not any(k.endswith("CUDA_VISIBLE_DEVICES") for k in spec.env)
    assert launch_in(("python3", "-m", "vllm")) is None and launch_in((*spec.argv[:-1], "{}")) is None
    assert isinstance(spec.timing, Timing)


def test_behind_the_proxy_the_container_engine_listens_on_its_socket_whose_folder_alone_is_mounted_writable(
        tmp_path, monkeypatch):
    """Issue 53: the engine in a container listened on serve.port, so a local user reached vLLM past the proxy's
    key (vLLM guards /v1 alone: /invocations answered anyone). Behind the proxy it listens on its Unix socket, as a
    process engine does: the socket's folder is mounted at its own path, read-write, and nothing listens on TCP."""
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    text = "  port: 8124\n  proxy: {enabled: true}\n  container: {image: 'localhost/e:1'}\n"
    serve = parse(f"serve:\n  model: /m/Qwen3-4B\n{text}").serve
    from test_drain import composed

    plain = engine_spec(serve, composed(text).command, me(), [])
    socket = str(tmp_path / "state" / "engine" / "8124.sock")
    assert plain.socket == socket and plain.port == 0
    spec = container_spec(plain, serve.container, simulated=True, port=serve.port)
    found = launch_in(spec.argv)
    assert found.name == "gpuwarden-vllm-8124" and spec.socket == socket
    assert found.argv[found.argv.index("--uds") + 1] == socket and "--port" not in found.argv
    folder = str(tmp_path / "state" / "engine")
    assert Mount(folder, folder, False) in found.mounts
    assert [m for m in found.mounts if not m.read_only] == [Mount(folder, folder, False)]  # the model stays read-only


def test_a_container_engine_behind_the_proxy_waits_to_start_while_its_config_file_has_a_key(tmp_path, monkeypatch):
    """Attacker 16: the engine's spec argv is the shim's, so the check before each start (preflight.keyed_flags)
    read no --config file there, and a key written into it without a reload reached the container's next start."""
    import dataclasses

    from gpuwarden.serving.run.preflight import keyed_flags

    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    flags = tmp_path / "flags.yaml"
    flags.write_text("max-num-seqs: 4\n")
    text = f"  port: 8125\n  args: [--config, {flags}]\n  proxy: {{enabled: true}}\n  container: {{image: 'e:1'}}\n"
    serve = parse(f"serve:\n  model: /m/Qwen3-4B\n{text}").serve
    from test_drain import composed

    plain = dataclasses.replace(engine_spec(serve, composed(text).command, me(), []), keyless_flags=True)
    spec = container_spec(plain, serve.container, simulated=True, port=serve.port)
    assert keyed_flags(spec) is None
    flags.write_text("max-num-seqs: 4\napi-k: written-later\n")
    assert keyed_flags(spec).startswith("with the proxy on, vLLM's flags give it an API key")


class FakeImages:
    """image_runtime and in_image's stand-ins: the image's ID as the runtime would say it, and each probe run's
    answer in turn (status, output); what each run was asked to run is kept."""

    def __init__(self, monkeypatch, image_id, *answers):
        from contextlib import contextmanager

        from gpuwarden.serving.compose import container, flagcheck

        monkeypatch.setattr(flagcheck, "_image_answers", {})
        self.image_id, self.answers, self.runs, self.made = image_id, list(answers), [], []

        @contextmanager
        def image_runtime(config):
            yield "runtime", self.image_id

        def in_image(runtime, config, uid, gid, argv, env, wait_s, machine=None, cancel=None, image_id=None,
                     mounts=None):
            self.runs.append((uid, gid, argv, dict(env), wait_s))
            self.made.append((image_id, mounts))
            return self.answers.pop(0)

        monkeypatch.setattr(container, "image_runtime", image_runtime)
        monkeypatch.setattr(container, "in_image", in_image)


ACCEPTS = (0, 'GPUWARDEN-FLAGCHECK {"ok": true, "error": null, "version": "0.32.0"}\n')
REFUSES = (0, 'usage: vllm serve [-h]\nvllm serve: error: unrecognized arguments: --no-such-flag\n'
              'GPUWARDEN-FLAGCHECK {"ok": false, "error": null, "version": "0.32.0"}\n')


def image_serve(tmp_path, extra=""):
    text = f"  port: 8126\n  env: {{HF_TOKEN: hf_x}}\n  container: {{image: 'localhost/e:1'}}\n{extra}"
    return parse(f"serve:\n  model: /m/Qwen3-4B\n{text}").serve, text


def test_a_container_engines_flags_are_checked_by_its_images_parser_once_per_image_id_and_command(
        tmp_path, monkeypatch):
    """Issue 53: the engine's own parser is the image's. check_flags runs the engine's probe in a container made
    from the image's ID (never this host's interpreter), as serve.user, with the engine's environment as the
    container gets it less its secrets; the parser's answer is kept per image ID and command: the same again asks
    nothing, a re-tag asks anew."""
    from test_drain import composed

    from gpuwarden.serving.compose import flagcheck

    images = FakeImages(monkeypatch, "sha256:aaa", ACCEPTS, ACCEPTS)
    serve, text = image_serve(tmp_path)
    command = composed(text).command
    spawned = []
    first = flagcheck.check_flags(serve, command, me(), 90, spawn=lambda *a, **k: spawned.append(a))
    assert first.ok and first.version == "0.32.0" and first.python == "python3 in localhost/e:1"
    assert spawned == []  # nothing of the host's
    (uid, gid, argv, env, wait_s), = images.runs
    assert (uid, gid, wait_s) == (999, 995, 90) and argv[:2] == ("python3", "-c")
    assert json.loads(argv[3]) == list(command.flags) and argv[2] == command.engine.flag_probe
    assert "HF_TOKEN" not in env and "PATH" not in env and "CUDA_VISIBLE_DEVICES" not in env  # the parser needs none
    assert images.made[0][0] == "sha256:aaa"  # made from the ID the answer is kept for, not the name
    assert flagcheck.check_flags(serve, command, me(), 90) == first and len(images.runs) == 1  # kept
    images.image_id = "sha256:bbb"  # the same name, another image
    assert flagcheck.check_flags(serve, command, me(), 90).ok and len(images.runs) == 2


def test_the_images_parser_refusing_names_its_reason_and_a_probe_that_did_not_answer_is_asked_again(
        tmp_path, monkeypatch):
    from test_drain import composed

    from gpuwarden.serving.compose import flagcheck
    from gpuwarden.serving.compose.prepare import flag_problem

    images = FakeImages(monkeypatch, "sha256:aaa", REFUSES, (None, ""), (1, "python3: not found\n"), ACCEPTS)
    config = parse(f"serve:\n  model: /m/Qwen3-4B\n  args: [--no-such-flag]\n{image_serve(tmp_path)[1]}")
    command = composed(image_serve(tmp_path, "  args: [--no-such-flag]\n")[1]).command
    refused = flagcheck.check_flags(config.serve, command, me(), 5)
    assert not refused.ok and refused.error == "unrecognized arguments: --no-such-flag"
    assert "serve.args: vLLM rejects the flags: unrecognized arguments: --no-such-flag" in str(
        flag_problem(config, command, refused))
    assert flagcheck.check_flags(config.serve, command, me(), 5) == refused and len(images.runs) == 1  # kept
    images.image_id = "sha256:bbb"
    late = flagcheck.check_flags(config.serve, command, me(), 5)
    assert not late.ok and not late.ran and late.error == "vLLM's flag check did not finish within 5 s"
    assert "serve.container.image: vLLM's flag check did not finish within 5 s (its flags are not checked)" in str(
        flag_problem(config, command, late))  # no verdict: not the flags' fault
    broken = flagcheck.check_flags(config.serve, command, me(), 5)  # not kept: asked again
    assert not broken.ok and not broken.ran and broken.error == "vLLM's flag check failed to run: python3: not found"
    assert flagcheck.check_flags(config.serve, command, me(), 5).ok and len(images.runs) == 4


def test_the_images_interpreter_is_serve_python_or_the_commands_own_else_python3():
    from gpuwarden.serving.compose.flagcheck import image_python

    image = ContainerConfig("localhost/e:1")
    assert image_python(ServeConfig(container=image, python="/opt/venv/bin/python"), ["vllm", "serve"]) == \
        "/opt/venv/bin/python"
    assert image_python(ServeConfig(container=image), ["/opt/venv/bin/python3.12", "-m", "vllm"]) == \
        "/opt/venv/bin/python3.12"
    assert image_python(ServeConfig(container=image), ["vllm", "serve"]) == "python3"  # its #! is in the image


def test_a_runtime_that_cannot_be_asked_is_one_line_of_the_flag_check(tmp_path, monkeypatch):
    from contextlib import contextmanager

    from test_drain import composed

    from gpuwarden.base.containerapi import RuntimeFault
    from gpuwarden.serving.compose import container, flagcheck

    @contextmanager
    def gone(config):
        raise RuntimeFault("podman's API socket /run/podman/podman.sock: No such file or directory")
        yield

    monkeypatch.setattr(container, "image_runtime", gone)
    serve, text = image_serve(tmp_path)
    found = flagcheck.check_flags(serve, composed(text).command, me(), 5)
    assert not found.ok and not found.ran and found.error == (
        "vLLM's flag check could not run in localhost/e:1: podman's API socket /run/podman/podman.sock: No such file "
        "or directory")


def test_a_reload_or_handover_to_another_container_engine_waits_for_the_images_parser(tmp_path, monkeypatch):
    """deepcheck.due: a container engine's launch is checked as a process engine's is (it was skipped: its parser was
    not run from here), where its spec differs from the engine that runs; the same spec asks nothing."""
    from types import SimpleNamespace

    from test_drain import composed

    from gpuwarden.serving.run.deepcheck import due

    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    serve, text = image_serve(tmp_path)
    command = composed(text).command
    spec = container_spec(engine_spec(serve, command, me(), []), serve.container, simulated=True, port=serve.port)
    launch = SimpleNamespace(command=command, engine=spec)
    other = container_spec(engine_spec(serve, composed(text + "  args: [--max-num-seqs, '4']\n").command, me(), []),
                           serve.container, simulated=True, port=serve.port)
    assert due(launch, SimpleNamespace(engine=SimpleNamespace(spec=other), pending=None))
    assert not due(launch, SimpleNamespace(engine=SimpleNamespace(spec=spec), pending=None))
    assert due(launch, SimpleNamespace(engine=SimpleNamespace(spec=spec), pending=None), upgraded=True)


def test_a_reload_restarts_a_container_engine_whose_image_name_is_now_another_image(monkeypatch):
    """A pull or a tag since the start gives the image's name another image: a reload with the config unchanged
    restarts the engine on it, as a process engine restarts on a vLLM upgraded under it (replan._upgraded). The
    same image, an image not read, or another container section (which restarts it anyway) says nothing."""
    from types import SimpleNamespace

    from gpuwarden.serving.lint.packages import Installed
    from gpuwarden.serving.run import replan

    config = parse("serve:\n  model: /m/Qwen3-4B\n  container: {image: 'localhost/e:1'}\n")
    launch = SimpleNamespace(config=config, command=SimpleNamespace(engine=SimpleNamespace(name="vllm", title="vLLM")),
                             image="sha256:" + "a" * 64)
    engine = SimpleNamespace(spec=SimpleNamespace(version="0.32.0"))
    found = {"now": Installed("image localhost/e:1", True, {"vllm": "0.32.0"}, stamp=("sha256:" + "b" * 64,))}
    monkeypatch.setattr(replan, "installed_for", lambda *a, **k: found["now"])
    assert replan._upgraded(config, launch, engine) == (
        "reload: localhost/e:1 is now image sha256:bbbbbbbbbbbb, the engine runs sha256:aaaaaaaaaaaa: restarting it "
        "on the new image")
    found["now"] = Installed("image localhost/e:1", True, {"vllm": "0.32.0"}, stamp=(launch.image,))
    assert replan._upgraded(config, launch, engine) is None
    found["now"] = Installed("image localhost/e:1", False, error="podman does not answer")
    assert replan._upgraded(config, launch, engine) is None
    found["now"] = Installed("image localhost/e:1", True, {"vllm": "0.32.0"}, stamp=("sha256:" + "b" * 64,))
    other = parse("serve:\n  model: /m/Qwen3-4B\n  container: {image: 'localhost/e:2'}\n")
    assert replan._upgraded(other, launch, engine) is None
    assert replan._upgraded(config, SimpleNamespace(**{**vars(launch), "image": None}), engine) is None


CRASHED = (0, 'GPUWARDEN-FLAGCHECK {"ok": false, "error": "ModuleNotFoundError: No module named \'vllm\'", '
              '"version": null}\n')


def test_an_exception_in_the_engines_code_is_answered_but_not_kept_and_the_probe_sees_the_engines_files(
        tmp_path, monkeypatch):
    """The review of the branch: an import that failed in the probe (a mount not there yet) is the probe's answer,
    not the parser's word, so it is asked again; a new mount is another key; the model's directory is mounted in
    the probe as in the engine's container (vLLM's validation opens a chat template there)."""
    from test_drain import composed

    from gpuwarden.serving.compose import flagcheck

    images = FakeImages(monkeypatch, "sha256:aaa", CRASHED, ACCEPTS, ACCEPTS)
    model = tmp_path / "model"
    model.mkdir()
    text = "  port: 8127\n  container: {image: 'localhost/e:1'}\n"
    serve = parse(f"serve:\n  model: {model}\n{text}").serve
    command = composed(text).command
    crashed = flagcheck.check_flags(serve, command, me(), 5)
    assert not crashed.ok and crashed.ran and crashed.error == "ModuleNotFoundError: No module named 'vllm'"
    assert flagcheck.check_flags(serve, command, me(), 5).ok and len(images.runs) == 2  # not kept: asked again
    assert Mount(str(model), str(model), True) in images.made[0][1]
    mounted = parse(f"serve:\n  model: {model}\n" + text.replace("'}", "', mounts: [/tmp:/extra]}")).serve
    assert flagcheck.check_flags(mounted, command, me(), 5).ok and len(images.runs) == 3  # another mount: asked
