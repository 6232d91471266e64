"""The container engine's system-call filter: the runtime's own seccomp profile, narrowed toward what the unit lets a
process engine do (units/gpuwarden.service: RestrictNamespaces=yes, RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
AF_NETLINK, SystemCallArchitectures=native, SystemCallFilter=@system-service without @mount and @debug).

podman 4.3.1's profile (containers-common's /usr/share/containers/seccomp.json) allows clone, clone3, unshare, setns,
keyctl, mount and ptrace to any container, and every socket family: inside the container serve.user could make a
user namespace with every capability in it, open AF_VSOCK sockets and reach the kernel keyring (attacker 12). The
narrowed profile keeps every other rule of the runtime's (a newer runtime's additions come with it) and:
- admits the native architecture alone (podman's maps x86-64 to i386 and x32 too, whose socketcall carries the
  family behind a pointer no filter reads: any family through `int 0x80`; the unit's SystemCallArchitectures=native);
- answers EPERM to unshare, setns, the mount calls, ptrace, pidfd_getfd, socketcall, io_uring (IORING_OP_SOCKET makes
  a socket no filter sees) and the keyring's calls (a uid's keyring is shared by all its processes, on the host too:
  stricter than the unit, whose @system-service has @keyring);
- allows clone only without a namespace flag, and answers clone3 ENOSYS, so that glibc falls back to clone (the
  rule Docker's own profile has for a container without CAP_SYS_ADMIN);
- allows socket for the unit's four families only (and NETLINK_AUDIT not, as podman's rule has it);
- allows personality only to query or to stay Linux's own (the unit's LockPersonality=yes).
process_vm_readv/writev stay as podman has them (the unit's @ipc has them; UCX's shared-memory transport, which
vLLM's NIXL connector uses, needs them).

Docker is left its default profile (moby's profiles/seccomp/default.json), which a container without CAP_SYS_ADMIN
gets: clone only without namespace flags, clone3 ENOSYS, no unshare, setns, mount or keyctl, AF_VSOCK refused; but it
keeps the i386 ABI and, before Docker 25, io_uring, each a way around its family rule (docs/serving/containers.md)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

from ...base import smallfile

# systemd's @mount and @debug (which @system-service leaves out), the namespace calls RestrictNamespaces= refuses,
# and the keyring: a call here gets EPERM, as SystemCallErrorNumber=EPERM answers a process engine.
DENIED = ("unshare", "setns", "mount", "umount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen",
          "fsconfig", "fsmount", "fspick", "mount_setattr", "ptrace", "pidfd_getfd", "socketcall", "io_uring_setup",
          "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key")
# CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET (linux/sched.h)
NAMESPACE_FLAGS = 0x7E020000
FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
AF_NETLINK, NETLINK_AUDIT = 16, 9
# Architectures of another word size, which podman admits beside the native one (its archMap's subArchitectures)
COMPAT = frozenset(("SCMP_ARCH_X86", "SCMP_ARCH_X32", "SCMP_ARCH_ARM", "SCMP_ARCH_MIPS", "SCMP_ARCH_MIPSEL",
                    "SCMP_ARCH_MIPS64N32", "SCMP_ARCH_MIPSEL64N32", "SCMP_ARCH_PPC", "SCMP_ARCH_S390"))
EPERM, ENOSYS = 1, 38
REPLACED = frozenset((*DENIED, "clone", "clone3", "socket", "personality"))
# personality(2): Linux's own (0) and the query (0xffffffff) only, as the unit's LockPersonality=yes leaves a process
# engine; podman's rule also lets PER_LINUX32 and UNAME26 through (attacker 19's F5)
PERSONALITIES = (0, 0xFFFFFFFF)
# containers-common's override first, as podman reads them (its DefaultSeccompPath); containers.conf's
# seccomp_profile before both
PODMAN_PROFILES = ("/etc/containers/seccomp.json", "/usr/share/containers/seccomp.json")
CONTAINERS_CONFS = ("/etc/containers/containers.conf", "/usr/share/containers/containers.conf")
CONF_MAX_BYTES = 1 << 20
PROFILE_MAX_BYTES = 1 << 20  # containers-common's is 16 KiB
FOLDER = "seccomp"  # under the state directory: one file per narrowed profile, named by its content


class SandboxFault(Exception):
    """The narrowed profile cannot be made; the message is one line."""


def narrowed(profile: object, source: str = "the profile") -> dict:
    """profile (an OCI seccomp profile as the runtime reads it) with this module's rules; SandboxFault where it is no
    allow-list (a default action that allows would let through what is taken out of its rules)."""
    if not isinstance(profile, dict) or not isinstance(profile.get("syscalls"), list):
        raise SandboxFault(f"{source} is no seccomp profile (no syscalls list)")
    default = profile.get("defaultAction")
    if not isinstance(default, str) or not default.startswith(("SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_TRAP")):
        raise SandboxFault(f"{source}'s default action is {default!r}, not a refusal: an allow-list is needed")
    out = copy.deepcopy(profile)
    for entry in out.get("archMap") or []:
        if isinstance(entry, dict):
            entry["subArchitectures"] = []
    if isinstance(out.get("architectures"), list):
        out["architectures"] = [a for a in out["architectures"] if a not in COMPAT]
    rules = []
    for rule in out["syscalls"]:
        if not isinstance(rule, dict):
            raise SandboxFault(f"{source} has a rule that is not an object")
        names = rule.get("names") if "names" in rule else [rule.get("name")]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise SandboxFault(f"{source} has a rule without a list of names")
        kept = [n for n in names if n not in REPLACED]
        if kept:
            rule.pop("name", None)
            rule["names"] = kept
            rules.append(rule)
    rules += [
        {"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": NAMESPACE_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        *({"names": ["personality"], "action": "SCMP_ACT_ALLOW",
           "args": [{"index": 0, "value": value, "valueTwo": 0, "op": "SCMP_CMP_EQ"}]} for value in PERSONALITIES),
        *({"names": ["socket"], "action": "SCMP_ACT_ALLOW",
           "args": [{"index": 0, "value": family, "valueTwo": 0, "op": "SCMP_CMP_EQ"},
                    *([{"index": 2, "value": NETLINK_AUDIT, "valueTwo": 0, "op": "SCMP_CMP_NE"}]
                      if family == AF_NETLINK else [])]} for family in FAMILIES),
    ]
    out["syscalls"] = rules
    return out


def configured_profile(confs: tuple[str, ...] = CONTAINERS_CONFS) -> str | None:
    """The profile containers.conf names ([containers] seccomp_profile, the first file that sets it), as podman picks
    it before its defaults; None: none named. SandboxFault: seccomp turned off there ("unconfined")."""
    import tomllib  # noqa: PLC0415 (3.11: Debian 12's Python)

    for path in confs:
        try:
            text = smallfile.read(path, CONF_MAX_BYTES, follow=True)
            found = tomllib.loads(text.decode()).get("containers", {}).get("seccomp_profile") if text else None
        except (smallfile.Unreadable, UnicodeDecodeError, tomllib.TOMLDecodeError, AttributeError) as exc:
            raise SandboxFault(f"{path} cannot be read for its seccomp_profile: {exc}") from None
        if found == "unconfined":
            raise SandboxFault(f"{path} turns seccomp off (seccomp_profile = \"unconfined\")")
        if isinstance(found, str) and found:
            return found
    return None


def base_profile(sources: tuple[str, ...] | None = None) -> tuple[str, dict]:
    """(its path, the profile) of the first of sources that exists (None: containers.conf's, else PODMAN_PROFILES);
    SandboxFault where none can be read."""
    if sources is None:
        named = configured_profile()
        sources = (named,) if named else PODMAN_PROFILES
    for path in sources:
        try:
            text = smallfile.read(path, PROFILE_MAX_BYTES, follow=True)  # past the cap: Unreadable
        except smallfile.Unreadable as exc:
            raise SandboxFault(f"podman's seccomp profile {path}: {exc}") from None
        if text is None:
            continue
        try:
            return path, json.loads(text)
        except ValueError as exc:
            raise SandboxFault(f"podman's seccomp profile {path} is not JSON: {exc}") from None
    raise SandboxFault(f"podman's seccomp profile is missing ({' and '.join(sources)} do not exist)")


def podman_profile(state: str, sources: tuple[str, ...] | None = None) -> str:
    """The path of the narrowed profile of podman's, under state (the state directory of the gpuwarden that makes
    the container: root's), written there once, named by its content; podman reads it at the create. Raises
    SandboxFault."""
    path, profile = base_profile(sources)
    text = json.dumps(narrowed(profile, path), sort_keys=True, indent=1)
    folder = os.path.join(state, FOLDER)
    target = os.path.join(folder, hashlib.sha256(text.encode()).hexdigest()[:16] + ".json")
    try:
        if smallfile.read(target, PROFILE_MAX_BYTES, follow=False) == text.encode():
            return target
    except smallfile.Unreadable:
        pass  # not there yet (or not ours): written below
    try:
        os.makedirs(folder, mode=0o755, exist_ok=True)
        smallfile.write_atomic(Path(target), text.encode(), mode=0o644, shared=True)  # the shim and a probe
    except OSError as exc:
        raise SandboxFault(f"the engine's seccomp profile cannot be written to {folder}: {exc.strerror}") from None
    return target
