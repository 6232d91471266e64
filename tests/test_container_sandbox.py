"""The container engine's system-call filter (serving/compose/sandbox.py, issue 53, attacker 12): podman's own
seccomp profile narrowed to the unit's rules, as data. tests/test_container_podman.py proves it inside a running
container: no user namespace, no keyring, no AF_VSOCK; threads, fork and the unit's socket families work."""

import json

import pytest

from gpuwarden.serving.compose import sandbox
from gpuwarden.serving.compose.container import ContainerLaunch, create, libpod_body

PODMAN_LIKE = {
    "defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 38,
    "syscalls": [
        {"names": ["read", "write", "clone", "clone3", "keyctl", "mount", "ptrace", "setns", "unshare"],
         "action": "SCMP_ACT_ALLOW"},
        {"names": ["bpf", "setns"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
        {"names": ["socket"], "action": "SCMP_ACT_ALLOW", "excludes": {"caps": ["CAP_AUDIT_WRITE"]}},
        {"name": "futex", "action": "SCMP_ACT_ALLOW"},
    ],
}


def rules_for(profile, name):
    return [rule for rule in profile["syscalls"] if name in rule["names"]]


def test_the_narrowed_profile_keeps_the_runtimes_rules_and_takes_namespaces_the_keyring_and_other_families_away():
    out = sandbox.narrowed(PODMAN_LIKE)
    assert out["defaultAction"] == "SCMP_ACT_ERRNO" and PODMAN_LIKE["syscalls"][0]["names"][2] == "clone"  # a copy
    assert rules_for(out, "read") == [{"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"}]
    assert rules_for(out, "bpf") == [{"names": ["bpf"], "action": "SCMP_ACT_ALLOW",
                                      "includes": {"caps": ["CAP_SYS_ADMIN"]}}]
    assert rules_for(out, "futex") == [{"names": ["futex"], "action": "SCMP_ACT_ALLOW"}]
    for name in ("unshare", "setns", "keyctl", "add_key", "mount", "ptrace", "socketcall", "io_uring_setup"):
        assert rules_for(out, name) == [{"names": list(sandbox.DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]
    assert "process_vm_readv" not in sandbox.DENIED  # the unit's @ipc has it; UCX's shared memory needs it
    (clone,) = rules_for(out, "clone")
    assert clone["action"] == "SCMP_ACT_ALLOW" and clone["args"] == [
        {"index": 0, "value": 0x7E020000, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]  # no CLONE_NEW* flag
    assert rules_for(out, "clone3") == [{"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}]
    sockets = rules_for(out, "socket")
    assert [r["args"][0]["value"] for r in sockets] == [1, 2, 10, 16] and {r["action"] for r in sockets} == {
        "SCMP_ACT_ALLOW"} and all(r["args"][0]["op"] == "SCMP_CMP_EQ" for r in sockets)
    assert sockets[-1]["args"][1] == {"index": 2, "value": 9, "valueTwo": 0, "op": "SCMP_CMP_NE"}  # NETLINK_AUDIT
    assert all(len(r["args"]) == 1 for r in sockets[:3])
    # personality: Linux's own and the query only (the unit's LockPersonality=yes; attacker 19's F5: PER_LINUX32 and
    # UNAME26 went through podman's rule)
    assert [r["args"] for r in rules_for(out, "personality")] == [
        [{"index": 0, "value": 0, "valueTwo": 0, "op": "SCMP_CMP_EQ"}],
        [{"index": 0, "value": 0xFFFFFFFF, "valueTwo": 0, "op": "SCMP_CMP_EQ"}]]


def test_the_narrowed_profile_admits_the_native_architecture_alone():
    """podman maps x86-64 to i386 and x32 too: through i386's socketcall (int 0x80) the family sits behind a pointer
    no rule reads, so any socket family would open (the review of the branch). The unit's SystemCallArchitectures=
    native, here: no sub-architecture, and an old-style architectures list keeps the 64-bit ones."""
    profile = {**PODMAN_LIKE, "archMap": [{"architecture": "SCMP_ARCH_X86_64",
                                           "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]},
                                          {"architecture": "SCMP_ARCH_AARCH64", "subArchitectures": ["SCMP_ARCH_ARM"]}],
               "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]}
    out = sandbox.narrowed(profile)
    assert [e["subArchitectures"] for e in out["archMap"]] == [[], []]
    assert out["architectures"] == ["SCMP_ARCH_X86_64"]
    assert profile["archMap"][0]["subArchitectures"] == ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]  # the runtime's, untouched


def test_containers_conf_names_the_profile_podman_narrows_and_unconfined_is_refused(tmp_path):
    conf = tmp_path / "containers.conf"
    conf.write_text('[containers]\nseccomp_profile = "/srv/strict.json"\n')
    assert sandbox.configured_profile((str(tmp_path / "none.conf"), str(conf))) == "/srv/strict.json"
    conf.write_text('[containers]\ndefault_ulimits = []\n')
    assert sandbox.configured_profile((str(conf),)) is None
    conf.write_text('[containers]\nseccomp_profile = "unconfined"\n')
    with pytest.raises(sandbox.SandboxFault, match="turns seccomp off"):
        sandbox.configured_profile((str(conf),))


@pytest.mark.parametrize("profile, said", [
    ({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}, "default action is 'SCMP_ACT_ALLOW', not a refusal"),
    ({"defaultAction": "SCMP_ACT_ERRNO"}, "is no seccomp profile"),
    ([], "is no seccomp profile"),
    ({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": ["read"]}, "a rule that is not an object"),
    ({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": "read"}]}, "a rule without a list of names"),
])
def test_a_profile_that_is_no_allow_list_is_refused_in_a_line(profile, said):
    with pytest.raises(sandbox.SandboxFault, match=said):
        sandbox.narrowed(profile, "/etc/containers/seccomp.json")


def test_the_profile_is_written_once_under_the_state_directory_named_by_its_content(tmp_path):
    source = tmp_path / "seccomp.json"
    source.write_text(json.dumps(PODMAN_LIKE))
    path = sandbox.podman_profile(str(tmp_path / "state"), (str(tmp_path / "override.json"), str(source)))
    assert path.startswith(str(tmp_path / "state" / "seccomp") + "/") and path.endswith(".json")
    assert json.loads(open(path).read()) == sandbox.narrowed(PODMAN_LIKE)
    assert sandbox.podman_profile(str(tmp_path / "state"), (str(source),)) == path  # the same content, the same file
    (tmp_path / "override.json").write_text(json.dumps({**PODMAN_LIKE, "defaultErrnoRet": 1}))
    other = sandbox.podman_profile(str(tmp_path / "state"), (str(tmp_path / "override.json"), str(source)))
    assert other != path and json.loads(open(other).read())["defaultErrnoRet"] == 1  # the override, first


def test_a_missing_or_oversized_or_broken_runtime_profile_is_one_line(tmp_path):
    with pytest.raises(sandbox.SandboxFault, match=r"podman's seccomp profile is missing \(.*/a.json and .*/b.json"):
        sandbox.base_profile((str(tmp_path / "a.json"), str(tmp_path / "b.json")))
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (sandbox.PROFILE_MAX_BYTES + 1))
    with pytest.raises(sandbox.SandboxFault, match="more than 1048576 bytes"):
        sandbox.base_profile((str(big),))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(sandbox.SandboxFault, match="bad.json is not JSON"):
        sandbox.base_profile((str(tmp_path / "bad.json"),))


def test_podmans_create_names_the_narrowed_profile_and_one_that_cannot_be_made_is_the_runtimes_fault(
        tmp_path, monkeypatch):
    from gpuwarden.base.containerapi import RuntimeFault

    class Runtime:
        def create_libpod(self, body):
            self.body = body
            return "cid"

    source = tmp_path / "seccomp.json"
    source.write_text(json.dumps(PODMAN_LIKE))
    monkeypatch.setattr(sandbox, "PODMAN_PROFILES", (str(source),))
    monkeypatch.setattr(sandbox.podman_profile, "__defaults__", ((str(source),),))
    launch = ContainerLaunch("podman", "/run/podman/podman.sock", "localhost/e:1", False, "gpuwarden-vllm-8000",
                             ("vllm", "serve"), (), "999:995", (), (), (), (("io.gpuwarden.state", str(tmp_path)),), 30)
    runtime = Runtime()
    assert create(runtime, launch, {}) == "cid"
    assert runtime.body["seccomp_profile_path"].startswith(str(tmp_path / "seccomp") + "/")
    assert set(runtime.body) - set(libpod_body(launch, {})) == {"seccomp_profile_path"}
    monkeypatch.setattr(sandbox.podman_profile, "__defaults__", ((str(tmp_path / "none.json"),),))
    with pytest.raises(RuntimeFault, match="podman's seccomp profile is missing .* golang-github-containers-common"):
        create(runtime, launch, {})


def test_check_says_a_podman_without_its_profile_once(tmp_path, monkeypatch):
    from gpuwarden import config as configmod
    from gpuwarden.serving.compose.container import NOT_READ, container_problems
    from gpuwarden.serving.lint.packages import Installed

    monkeypatch.setattr(sandbox.base_profile, "__defaults__", ((str(tmp_path / "none.json"),),))
    config = configmod.parse_text("serve:\n  model: /m\n  container: {image: 'localhost/e:1'}\n", name="c.yaml")
    fault = "podman's seccomp profile is missing"
    failed = Installed("image localhost/e:1", False, error=f"{fault} ({tmp_path}/none.json do not exist) (install)")
    problems = [str(p) for p in container_problems(config, "vllm", failed, simulated=True)]
    assert len(problems) == 1 and "serve.container.runtime: podman's seccomp profile is missing" in problems[0]
    assert "the engine would run without the unit's system-call rules" in problems[0]
    docker = configmod.parse_text("serve:\n  model: /m\n  container: {image: 'e:1', runtime: docker}\n", name="c.yaml")
    unread = Installed("image e:1", False, error=f"image e:1 {NOT_READ}")
    assert container_problems(docker, "vllm", unread, simulated=True) == []  # Docker's own profile has the rules


def test_only_roots_runtime_socket_is_asked_and_podman_answering_for_docker_is_refused():
    """Attacker 19's F2: a socket a local user made got every create of the shim, the engine's secrets in each; F1:
    runtime docker on podman's socket ran the engine under podman's wide profile (a user namespace with every
    capability, keyctl, AF_VSOCK), and check said OK."""
    import os
    import stat

    from gpuwarden.base.containerapi import not_roots, product_of

    def st(uid, mode):
        return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))

    sock, folder = stat.S_IFSOCK | 0o660, stat.S_IFDIR | 0o755
    assert not_roots("/run/podman/podman.sock", st(0, sock), st(0, folder)) is None
    assert not_roots("/tmp/x/podman.sock", st(0, sock), st(0, stat.S_IFDIR | 0o1777)) is None  # sticky: root's stays
    mine = not_roots("/tmp/evil/podman.sock", st(1001, stat.S_IFSOCK | 0o777), st(1001, folder))
    assert mine.startswith("/tmp/evil/podman.sock is not root's (its owner is uid 1001)"), mine
    swappable = not_roots("/srv/rt/podman.sock", st(0, sock), st(0, stat.S_IFDIR | 0o777))
    assert swappable.startswith("/srv/rt may be changed by a user other than root"), swappable
    assert not_roots("/srv/rt/podman.sock", st(0, sock), st(1001, folder)) is not None
    podman = {"Version": "4.3.1", "Components": [{"Name": "Podman Engine", "Version": "4.3.1"}]}
    docker = {"Version": "27.3.1", "Components": [{"Name": "Engine"}, {"Name": "containerd"}, {"Name": "runc"}]}
    assert product_of(podman) == "podman" and product_of(docker) == "docker" and product_of({}) == "docker"


def test_a_mount_on_the_way_to_the_engines_socket_folder_is_refused_at_check(tmp_path, monkeypatch):
    """Attacker 19's F3: a mount at the engine's socket folder passed check; a reload to it drained the healthy engine,
    then podman refused each new container (duplicate mount destination) and serving ended FATAL."""
    from gpuwarden import config as configmod
    from gpuwarden.serving.compose.container import container_problems, overlaps
    from gpuwarden.serving.lint.packages import Installed

    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    engine_dir = tmp_path / "state" / "engine"
    text = ("serve:\n  model: /m\n  container:\n    image: 'e:1'\n    runtime: docker\n    mounts:\n"
            f"      - {tmp_path}:{engine_dir}\n      - {tmp_path}:{tmp_path / 'state'}\n      - {tmp_path}:/hf\n")
    config = configmod.parse_text(text, name="c.yaml")
    found = Installed("image e:1", True, {"vllm": "0.32.0"})
    problems = [str(p) for p in container_problems(config, "vllm", found, simulated=True)]
    assert [p.split(": ")[1] for p in problems] == ["serve.container.mounts.0", "serve.container.mounts.1"], problems
    assert f"is on the way to {engine_dir}, the engine's socket folder" in problems[0]
    assert overlaps("/a/b", "/a/b/") and overlaps("/a", "/a/b") and overlaps("/a/b/c", "/a/b")
    assert not overlaps("/a/bc", "/a/b") and not overlaps("/hf", "/var/lib/gpuwarden/engine")
