#!/usr/bin/env python3
"""A CUDA program under the unit's system-call filter, on a real GPU, read-only (RESULTS.md section 27).

units/gpuwarden.service gives the daemon, and so vLLM, its children, `SystemCallFilter=@system-service`,
`SystemCallErrorNumber=EPERM`, `SystemCallArchitectures=native`, `NoNewPrivileges=yes`,
`RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK`, `RestrictNamespaces=yes`, `LockPersonality=yes`
and `RestrictRealtime=yes`. This script installs seccomp filters that do what systemd 252 (Debian 12) makes of
those lines, in a worker process, and runs a CUDA program there: torch on the GPU (a bf16 matmul, a CUDA graph,
torch.compile through inductor and Triton, which run the C compiler and ptxas), NVML reads, an NCCL
process group of one, a multiprocessing child started by spawn (as vLLM starts its workers), and nvidia-smi.
Everything it does to the card is a read or a computation: no setting is changed.

What systemd 252 does, modelled here with classic BPF, stacked in systemd's order (execute.c applies the
filter last):
  RestrictAddressFamilies  socket() with a family outside AF_UNIX/AF_INET/AF_INET6/AF_NETLINK: EAFNOSUPPORT
  RestrictRealtime         sched_setscheduler() to a policy other than OTHER, BATCH, IDLE: EPERM
  RestrictNamespaces       clone()/unshare() with a CLONE_NEW* flag, setns(): EPERM; clone3(): ENOSYS (its
                           flags are behind a pointer a filter cannot read, so glibc falls back to clone())
  SystemCallArchitectures  any other architecture (x32 on x86-64 too): the process is killed
  LockPersonality          personality() other than PER_LINUX or the query 0xffffffff: EPERM
  RestrictSUIDSGID         chmod/fchmod/fchmodat/mkdir/mkdirat/mknod/mknodat/creat, open/openat with O_CREAT,
                           with a set-uid or set-gid mode bit: EPERM; openat2(): ENOSYS (flags behind a pointer)
  SystemCallFilter         @system-service (groups expanded) allowed; every other call: EPERM
                           (SystemCallErrorNumber), calls newer than systemd's tables too: systemd 252 loads the
                           allow-list with the errno as libseccomp's default action and adds no ENOSYS rule
                           (read in its libsystemd-core-252.so, exec_child -> seccomp_load_syscall_filter_set_raw)
Not modelled: MemoryDenyWriteExecute (off in the unit), and everything that is no seccomp filter
(DevicePolicy/DeviceAllow, ProtectSystem, the capability bounding set, PrivateTmp, ...). The calls that
ProtectClock, ProtectHostname, ProtectKernelLogs and ProtectKernelModules refuse lie outside @system-service
anyway, so the filter refuses them already.

The names come from `systemd-analyze syscall-filter` (systemd 252) and their numbers from libseccomp 2.5.4
(the one systemd 252 links on Debian 12), kept in cuda_under_filter_syscalls.json beside this script:
`--regen-data` rebuilds that file on a machine with both. Names that do not exist on the architecture are
skipped, as systemd skips them, and counted.

Then, unless --no-audit, the same steps run again with every refusal turned into SECCOMP_RET_TRAP carrying the
same errno, and a SIGSYS handler (a small C library, LD_PRELOADed so the spawned child and nvidia-smi have it
too) logs the call and makes it return that errno: the same behaviour, with a list of what was refused and by
whom. A failed step is explained by that list (or, where it is empty, by no refused call). clone3 is answered
ENOSYS there without a trap (see prog_namespaces); a refused call made with SIGSYS blocked would kill the
process in the audit run alone, so an audit-only failure is no finding about the filter.

    python3 benchmarks/cuda_under_filter.py --require-gpu --out $OUT/cuda_under_filter.json

Without a GPU (and without --require-gpu) the CUDA steps are skipped with a message; the filter, its controls,
the exec'd and spawned children are still checked. Exit status 0 only if every check and every step that ran
passed.
"""

import argparse
import ctypes
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "cuda_under_filter_syscalls.json")

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_TRAP = 0x00030000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000

EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97
PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET = 1, 2, 10, 16, 17
ALLOWED_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
# systemd 252's namespace flags (nsflags.c): cgroup, ipc, net, mnt, pid, user, uts
CLONE_NEW_ALL = 0x02000000 | 0x08000000 | 0x40000000 | 0x00020000 | 0x20000000 | 0x10000000 | 0x04000000
CLONE_NEWUTS = 0x04000000
S_ISUID, S_ISGID, O_CREAT = 0o4000, 0o2000, 0o100

# classic BPF
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
OFF_NR, OFF_ARCH = 0, 4


def off_arg(i, high=False):
    return 16 + 8 * i + (4 if high else 0)  # little endian: the low word first


class Prog:
    """A classic BPF program with labels (jumps are 8-bit, so they stay short here)."""

    def __init__(self):
        self.ops = []  # (code, jt, jf, k); jt/jf are ints or label names
        self.labels = {}

    def op(self, code, k=0, jt=0, jf=0):
        self.ops.append([code, jt, jf, k])

    def label(self, name):
        self.labels[name] = len(self.ops)

    def build(self):
        out = []
        for i, (code, jt, jf, k) in enumerate(self.ops):
            def rel(t):
                if isinstance(t, str):
                    t = self.labels[t] - i - 1
                assert 0 <= t <= 255, (i, t)
                return t
            out.append(struct.pack("=HBBI", code, rel(jt), rel(jf), k & 0xFFFFFFFF))
        assert len(out) <= 4096
        return b"".join(out)


def ret_refuse(errno, trap):
    return (SECCOMP_RET_TRAP if trap else SECCOMP_RET_ERRNO) | errno


def prog_arch(arch):
    """SystemCallArchitectures=native: another architecture is killed (on x86-64 x32 counts as another)."""
    p = Prog()
    p.op(LD_W_ABS, OFF_ARCH)
    p.op(JEQ_K, AUDIT_ARCH[arch], jt=1)
    p.op(RET_K, SECCOMP_RET_KILL_PROCESS)
    if arch == "x86_64":
        p.op(LD_W_ABS, OFF_NR)
        p.op(JGE_K, X32_SYSCALL_BIT, jf=1)
        p.op(RET_K, SECCOMP_RET_KILL_PROCESS)
    p.op(RET_K, SECCOMP_RET_ALLOW)
    return p


def _native_nr(p, arch):
    """Load the call's number; on another architecture (or x32) allow: prog_arch kills those."""
    p.op(LD_W_ABS, OFF_ARCH)
    p.op(JEQ_K, AUDIT_ARCH[arch], jt=1)
    p.op(RET_K, SECCOMP_RET_ALLOW)
    p.op(LD_W_ABS, OFF_NR)
    if arch == "x86_64":
        p.op(JGE_K, X32_SYSCALL_BIT, jf=1)
        p.op(RET_K, SECCOMP_RET_ALLOW)


def _argument_in(arch, syscall, arg, allowed, errno, trap):
    """syscall allowed only when its argument arg (its high word 0) is one of allowed; else errno."""
    p = Prog()
    _native_nr(p, arch)
    p.op(JEQ_K, syscall, jf="allow")
    p.op(LD_W_ABS, off_arg(arg, high=True))
    p.op(JEQ_K, 0, jf="refuse")
    p.op(LD_W_ABS, off_arg(arg))
    for value in allowed:
        p.op(JEQ_K, value, jt="allow")
    p.label("refuse")
    p.op(RET_K, ret_refuse(errno, trap))
    p.label("allow")
    p.op(RET_K, SECCOMP_RET_ALLOW)
    return p


def prog_address_families(arch, nr, trap):
    return _argument_in(arch, nr["socket"], 0, ALLOWED_FAMILIES, EAFNOSUPPORT, trap)


def prog_realtime(arch, nr, trap):
    return _argument_in(arch, nr["sched_setscheduler"], 1, (0, 3, 5), EPERM, trap)  # SCHED_OTHER, BATCH, IDLE


def prog_namespaces(arch, nr, trap):
    p = Prog()
    _native_nr(p, arch)
    p.op(JEQ_K, nr["clone3"], jf=1)
    # never trapped: glibc's pthread_create and posix_spawn call clone3 with every signal blocked, and a SIGSYS
    # forced on a blocked handler kills the process (the audit run would die where the real filter does not)
    p.op(RET_K, SECCOMP_RET_ERRNO | ENOSYS)
    p.op(JEQ_K, nr["setns"], jt="refuse")
    p.op(JEQ_K, nr["unshare"], jt="flags")
    p.op(JEQ_K, nr["clone"], jf="allow")  # flags are clone's first argument except on s390
    p.label("flags")
    p.op(LD_W_ABS, off_arg(0))
    p.op(JSET_K, CLONE_NEW_ALL, jf="allow")
    p.label("refuse")
    p.op(RET_K, ret_refuse(EPERM, trap))
    p.label("allow")
    p.op(RET_K, SECCOMP_RET_ALLOW)
    return p


def prog_personality(arch, nr, trap):
    return _argument_in(arch, nr["personality"], 0, (0, 0xFFFFFFFF), EPERM, trap)  # PER_LINUX, the query


def prog_suid_sgid(arch, nr, trap):
    """RestrictSUIDSGID: a set-uid/set-gid mode bit in the mode argument (with O_CREAT for open/openat): EPERM."""
    p = Prog()
    _native_nr(p, arch)
    p.op(JEQ_K, nr["openat2"], jf=1)
    p.op(RET_K, ret_refuse(ENOSYS, trap))
    mode_arg = [(s, i) for s, i in (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("mkdir", 1), ("mkdirat", 2),
                                    ("mknod", 1), ("mknodat", 2), ("creat", 1)) if s in nr]
    for s, i in mode_arg:
        p.op(JEQ_K, nr[s], jt=f"mode{i}")
    if "open" in nr:
        p.op(JEQ_K, nr["open"], jt="open")
    p.op(JEQ_K, nr["openat"], jf="allow")
    p.op(LD_W_ABS, off_arg(2))
    p.op(JSET_K, O_CREAT, jt="mode3", jf="allow")
    p.label("open")
    p.op(LD_W_ABS, off_arg(1))
    p.op(JSET_K, O_CREAT, jt="mode2", jf="allow")
    for i in (1, 2, 3):
        p.label(f"mode{i}")
        p.op(LD_W_ABS, off_arg(i))
        p.op(JSET_K, S_ISUID | S_ISGID, jt="refuse", jf="allow")
    p.label("refuse")
    p.op(RET_K, ret_refuse(EPERM, trap))
    p.label("allow")
    p.op(RET_K, SECCOMP_RET_ALLOW)
    return p


def prog_syscall_filter(arch, allowed, trap):
    """SystemCallFilter=@system-service with SystemCallErrorNumber=EPERM: allowed numbers pass, any other EPERM."""
    p = Prog()
    _native_nr(p, arch)
    for n in sorted(allowed):
        p.op(JEQ_K, n, jf=1)
        p.op(RET_K, SECCOMP_RET_ALLOW)
    p.op(RET_K, ret_refuse(EPERM, trap))
    return p


def load_data():
    with open(DATA) as f:
        return json.load(f)


def plan(data, arch):
    """The numbers for this architecture: (nr by name, allowed set, refused set, counts)."""
    table = data["numbers"][arch]
    nr = {name: n for name, n in table.items() if n >= 0}
    service = data["system_service"]
    known = data["known"]
    allowed = {nr[s] for s in service if s in nr}
    refused = {nr[s] for s in known if s in nr} - allowed
    counts = {
        "system_service_names": len(service),
        "system_service_allowed": len(allowed),
        "system_service_skipped_not_on_arch": sorted(s for s in service if s not in nr),
        "known_names": len(known),
        "known_outside_the_set": len(refused),
        "known_skipped_not_on_arch": len([s for s in known if s not in nr]),
        "highest_known_nr": max(nr[s] for s in known if s in nr),
    }
    counts["system_service_skipped_count"] = len(counts["system_service_skipped_not_on_arch"])
    return nr, allowed, refused, counts


def libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    lib.prctl.restype = ctypes.c_int
    return lib


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(progs):
    lib = libc()
    PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
    if lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    sizes = []
    for name, prog in progs:
        code = prog.build()
        buf = ctypes.create_string_buffer(code, len(code))
        fprog = SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
        if lib.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl(PR_SET_SECCOMP) for {name}")
        sizes.append((name, len(code) // 8))
    return sizes


def raw(nr, *args):
    """A raw system call: (return value, errno)."""
    lib = libc()
    ctypes.set_errno(0)
    r = lib.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return r, (ctypes.get_errno() if r == -1 else 0)


def errname(e):
    import errno as errno_mod
    return errno_mod.errorcode.get(e, str(e)) if e else "ok"


def controls(nr, filtered):
    """Calls whose answer shows the filter: each harmless whether or not it is let through."""
    out = {}
    nowhere = ctypes.c_char_p(b"/nonexistent/cuda-under-filter")
    out["perf_event_open(NULL) [@debug]"] = raw(nr["perf_event_open"], 0, 0, -1, -1, 0)[1]
    out["pidfd_getfd(-1, -1) [@debug]"] = raw(nr["pidfd_getfd"], -1, -1, 0)[1]
    out["swapoff(nonexistent path) [@swap]"] = raw(nr["swapoff"], nowhere)[1]
    out["syscall 1000 (unknown to systemd)"] = raw(1000)[1]
    if "cachestat" not in nr:  # 6.5's, newer than systemd 252's tables
        out["cachestat(-1) (x86-64 451, newer than systemd 252)"] = raw(451, -1, 0, 0, 0)[1] \
            if platform.machine() == "x86_64" else None
    out["clone3(NULL, 0) [RestrictNamespaces]"] = raw(nr["clone3"], 0, 0)[1]
    how = (ctypes.c_uint64 * 3)(0, 0, 0)  # struct open_how: flags, mode, resolve
    out["openat2(nonexistent) [RestrictSUIDSGID]"] = raw(nr["openat2"], -100, nowhere, ctypes.byref(how), 24)[1]
    out["chmod(nonexistent, 04755) [RestrictSUIDSGID]"] = raw(nr["chmod"], nowhere, 0o4755)[1]
    out["chmod(nonexistent, 0755)"] = raw(nr["chmod"], nowhere, 0o755)[1]
    out["personality(PER_LINUX32) [LockPersonality]"] = None
    out["personality(query)"] = raw(nr["personality"], 0xFFFFFFFF)[1]
    param = ctypes.c_int(1)
    if filtered:  # these would change this process if let through: checked under the filter alone
        out["personality(PER_LINUX32) [LockPersonality]"] = raw(nr["personality"], 0x0008)[1]
        out["unshare(CLONE_NEWUTS) [RestrictNamespaces]"] = raw(nr["unshare"], CLONE_NEWUTS)[1]
        out["sched_setscheduler(0, SCHED_FIFO) [RestrictRealtime]"] = \
            raw(nr["sched_setscheduler"], 0, 1, ctypes.byref(param))[1]
    else:
        del out["personality(PER_LINUX32) [LockPersonality]"]
    for name, af, kind, proto in (("AF_PACKET", AF_PACKET, 2, 0), ("AF_UNIX", AF_UNIX, 1, 0),
                                  ("AF_INET", AF_INET, 2, 0), ("AF_NETLINK", AF_NETLINK, 3, 0)):
        r, e = raw(nr["socket"], af, kind, proto)
        if r >= 0:
            os.close(r)
        out[f"socket({name}) [RestrictAddressFamilies]"] = e
    return {k: (errname(v) if v is not None else "not run") for k, v in out.items()}


EXPECTED_FILTERED = {
    "perf_event_open(NULL) [@debug]": "EPERM",
    "pidfd_getfd(-1, -1) [@debug]": "EPERM",
    "swapoff(nonexistent path) [@swap]": "EPERM",
    "syscall 1000 (unknown to systemd)": "EPERM",
    "cachestat(-1) (x86-64 451, newer than systemd 252)": "EPERM",
    "openat2(nonexistent) [RestrictSUIDSGID]": "ENOSYS",
    "chmod(nonexistent, 04755) [RestrictSUIDSGID]": "EPERM",
    "chmod(nonexistent, 0755)": "ENOENT",
    "clone3(NULL, 0) [RestrictNamespaces]": "ENOSYS",
    "personality(PER_LINUX32) [LockPersonality]": "EPERM",
    "personality(query)": "ok",
    "unshare(CLONE_NEWUTS) [RestrictNamespaces]": "EPERM",
    "sched_setscheduler(0, SCHED_FIFO) [RestrictRealtime]": "EPERM",
    "socket(AF_PACKET) [RestrictAddressFamilies]": "EAFNOSUPPORT",
    "socket(AF_UNIX) [RestrictAddressFamilies]": "ok",
    "socket(AF_INET) [RestrictAddressFamilies]": "ok",
    "socket(AF_NETLINK) [RestrictAddressFamilies]": "ok",
    "x32 getpid, in a child [SystemCallArchitectures]": "killed by SIGSYS",
}


def seccomp_status():
    with open("/proc/self/status") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f)
                if k in ("Seccomp", "Seccomp_filters", "NoNewPrivs")}


# ---------------------------------------------------------------- the steps (in the filtered worker)

def gpu_present():
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    return True, torch.cuda.get_device_name(0)


def step_import_torch():
    t = time.perf_counter()
    import torch
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "import_s": round(time.perf_counter() - t, 2)}


def step_cuda_init():
    import torch
    t = time.perf_counter()
    n = torch.cuda.device_count()
    torch.zeros(1, device="cuda")
    out = {"devices": n, "name": torch.cuda.get_device_name(0),
           "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
           "init_s": round(time.perf_counter() - t, 2)}
    cuda = ctypes.CDLL("libcuda.so.1")
    v = ctypes.c_int()
    cuda.cuDriverGetVersion(ctypes.byref(v))
    out["cuDriverGetVersion"] = v.value
    return out


def step_matmul(n=8192, reps=20):
    import torch
    torch.manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        c = a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        c = a @ b
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / reps
    finite = bool(torch.isfinite(c).all())
    k = 64  # a corner against the CPU in float32
    ref = a[:k].float().cpu() @ b[:, :k].float().cpu()
    got = c[:k, :k].float().cpu()
    scale = (a[:k].float().cpu().norm(dim=1)[:, None] * b[:, :k].float().cpu().norm(dim=0)[None, :])
    worst = float(((got - ref).abs() / scale).max())  # bf16 output rounding is ~2^-9 of |c| <= the scale
    one = (float(got[3, 5]), float(ref[3, 5]))
    ok = finite and worst < 1e-2
    return {"ok": ok, "n": n, "reps": reps, "ms_per_matmul": round(ms, 3),
            "tflops": round(2 * n ** 3 / (ms / 1e3) / 1e12, 1), "finite": finite,
            "c[3,5] gpu, cpu": [round(one[0], 3), round(one[1], 3)],
            "worst |gpu-cpu| / (|a_i| |b_j|) over a 64x64 corner": worst}


def step_cuda_graph():
    import torch
    x = torch.randn(1024, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            y = torch.relu(x @ w) + 1
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = torch.relu(x @ w) + 1
    x.copy_(torch.randn(1024, 1024, device="cuda"))
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    err = float((y - (torch.relu(x @ w) + 1)).abs().max())
    return {"ok": err < 1e-3, "replays": 10, "max_abs_diff_vs_eager": err}


def step_cpu_matmul():
    """torch on the CPU (its thread pool too): the part of the program that needs no GPU."""
    import torch
    torch.manual_seed(0)
    a, b = torch.randn(1024, 1024, dtype=torch.bfloat16), torch.randn(1024, 1024, dtype=torch.bfloat16)
    c = (a @ b).float()
    ref = a.float() @ b.float()
    err = float(((c - ref).abs() / (a.float().norm(dim=1)[:, None] * b.float().norm(dim=0)[None, :])).max())
    return {"ok": bool(torch.isfinite(c).all()) and err < 1e-2, "threads": torch.get_num_threads(), "worst": err}


def step_torch_compile(device):
    import torch
    t = time.perf_counter()

    def f(x):
        return torch.sin(x) * x + torch.cos(x).sum(dim=-1, keepdim=True)

    cf = torch.compile(f)
    x = torch.randn(4096, 512, device=device)
    got = cf(x)
    if device == "cuda":
        torch.cuda.synchronize()
    err = float((got - f(x)).abs().max())
    return {"ok": err < 1e-3, "device": device, "max_abs_diff_vs_eager": err,
            "compile_s": round(time.perf_counter() - t, 1), "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}


def step_nvml():
    try:
        import pynvml
    except ImportError:
        return {"ok": None, "skipped": "pynvml (nvidia-ml-py) is not installed"}
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        return {"ok": True, "devices": pynvml.nvmlDeviceGetCount(),
                "name": name.decode() if isinstance(name, bytes) else name,
                "driver": (lambda d: d.decode() if isinstance(d, bytes) else d)(pynvml.nvmlSystemGetDriverVersion()),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000,
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "memory_used_mib": pynvml.nvmlDeviceGetMemoryInfo(h).used // 2 ** 20,
                "energy_mj": pynvml.nvmlDeviceGetTotalEnergyConsumption(h)}
    finally:
        pynvml.nvmlShutdown()


def step_nccl():
    import socket

    import torch
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        ok = bool((t == 1).all())
        v = torch.cuda.nccl.version()
        return {"ok": ok, "backend": dist.get_backend(), "nccl": ".".join(map(str, v)) if isinstance(v, tuple) else v}
    finally:
        dist.destroy_process_group()


def probe_filtered():
    """perf_event_open(NULL): EPERM under the filter; EFAULT (or ENOSYS/ENODEV where it is missing) without."""
    return errname(raw(PERF_EVENT_OPEN.get(platform.machine(), -1), 0, 0, -1, -1, 0)[1])


def _spawn_child(q, use_cuda):
    out = {"status": seccomp_status(), "pid": os.getpid(), "perf_event_open": probe_filtered()}
    try:
        if use_cuda:
            import torch
            x = torch.arange(1 << 20, device="cuda", dtype=torch.float64)
            out["sum"] = float(x.sum())
            out["expected"] = float((1 << 20) * ((1 << 20) - 1) / 2)
    except Exception as e:  # reported to the parent, not raised
        out["error"] = repr(e)
    q.put(out)


def step_spawn_child(use_cuda):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_spawn_child, args=(q, use_cuda))
    p.start()
    got, deadline = None, time.monotonic() + 180
    while got is None and time.monotonic() < deadline:
        try:
            got = q.get(timeout=1)
        except Exception:
            if not p.is_alive() and q.empty():
                break
    got = got or {"error": "no answer from the child"}
    p.join(60)
    got["exitcode"] = p.exitcode
    inherited = got.get("perf_event_open") == "EPERM"
    ok = p.exitcode == 0 and "error" not in got and inherited
    if use_cuda:
        ok = ok and got.get("sum") == got.get("expected")
    got["ok"] = ok
    got["filter_inherited"] = inherited
    return got


def step_exec_child():
    """An exec'd program (grep, then python3) still has the filter."""
    r = subprocess.run(["grep", "-E", "^(Seccomp|Seccomp_filters|NoNewPrivs):", "/proc/self/status"],
                       capture_output=True, text=True, timeout=30)
    code = ("import sys; sys.path.insert(0, %r); import cuda_under_filter as c; print(c.probe_filtered())" % HERE)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return {"ok": p.returncode == 0 and p.stdout.strip() == "EPERM", "python3 -c: perf_event_open": p.stdout.strip(),
            "grep's own /proc/self/status": r.stdout.strip().split("\n")}


def step_nvidia_smi():
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {"ok": False, "error": "nvidia-smi not on PATH"}
    r = subprocess.run([exe, "--query-gpu=name,driver_version,power.draw,clocks.sm", "--format=csv"],
                       capture_output=True, text=True, timeout=60)
    return {"ok": r.returncode == 0, "rc": r.returncode, "stdout": r.stdout.strip().splitlines(),
            "stderr": r.stderr.strip()[-500:]}


def worker(args):
    data = load_data()
    arch = platform.machine()
    nr, allowed, refused, counts = plan(data, arch)
    res = {"mode": args.worker, "arch": arch, "counts": counts, "steps": {}}
    path = args.result

    def save():
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    def mark(text):
        if os.environ.get("CUF_TRAP_LOG"):
            with open(os.environ["CUF_TRAP_LOG"], "a") as f:
                f.write(f"## {text}\n")

    res["threads_before_filter"] = len(os.listdir("/proc/self/task"))
    trap = args.worker == "trap"
    progs = [("RestrictAddressFamilies", prog_address_families(arch, nr, trap)),
             ("RestrictRealtime", prog_realtime(arch, nr, trap)),
             ("RestrictSUIDSGID", prog_suid_sgid(arch, nr, trap)),
             ("RestrictNamespaces", prog_namespaces(arch, nr, trap)),
             ("SystemCallArchitectures", prog_arch(arch)),
             ("LockPersonality", prog_personality(arch, nr, trap)),
             ("SystemCallFilter", prog_syscall_filter(arch, allowed, trap))]
    mark("install")
    res["filters"] = install(progs)
    res["status_after_install"] = seccomp_status()
    mark("controls")
    res["controls"] = controls(nr, filtered=True)
    if arch == "x86_64":  # an x32 call (getpid | X32_SYSCALL_BIT) kills the process: in a child
        k = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL(None).syscall(0x40000027)"],
                           capture_output=True, timeout=60)
        res["controls"]["x32 getpid, in a child [SystemCallArchitectures]"] = \
            "killed by SIGSYS" if k.returncode == -31 else f"rc {k.returncode}"
    res["controls_as_expected"] = all(res["controls"].get(k) == v for k, v in EXPECTED_FILTERED.items()
                                      if k in res["controls"])
    save()

    try:
        mark("step import_torch")
        res["steps"]["import_torch"] = step_import_torch()  # first: its timing is the import's
        res["steps"]["import_torch"].update(ok=True, s=res["steps"]["import_torch"]["import_s"])
        have_torch = True
    except ImportError as e:
        res["steps"]["import_torch"] = {"ok": None, "skipped": repr(e)}
        have_torch = False
    except Exception as e:
        res["steps"]["import_torch"] = {"ok": False, "error": repr(e), "traceback": traceback.format_exc()[-3000:]}
        have_torch = False
    print(f"[{args.worker}] import_torch: {res['steps']['import_torch']}", flush=True)
    have_gpu, why = gpu_present() if have_torch else (False, "torch did not import")
    res["gpu"] = {"present": have_gpu, "detail": why}
    save()
    steps = [("cuda_init", step_cuda_init, "gpu"), ("nvml", step_nvml, "gpu"), ("matmul_bf16", step_matmul, "gpu"),
              ("cuda_graph", step_cuda_graph, "gpu"),
              ("cpu_matmul", step_cpu_matmul, "torch"),
              ("torch_compile", lambda: step_torch_compile("cuda" if have_gpu else "cpu"), "torch"),
              ("nccl_world_1", step_nccl, "gpu"),
              ("spawn_child", lambda: step_spawn_child(have_gpu), None),
              ("exec_child", step_exec_child, None), ("nvidia_smi", step_nvidia_smi, "gpu")]
    for name, fn, needs in steps:
        if args.steps and name not in args.steps:
            continue
        if (needs == "gpu" and not have_gpu) or (needs == "torch" and not have_torch):
            res["steps"][name] = {"ok": None, "skipped": why}
            print(f"[{args.worker}] {name}: skipped ({res['steps'][name]['skipped']})", flush=True)
            continue
        mark(f"step {name}")
        t = time.perf_counter()
        try:
            out = fn()
            out.setdefault("ok", True)
        except Exception as e:
            out = {"ok": False, "error": repr(e), "traceback": traceback.format_exc()[-3000:]}
        out["s"] = round(time.perf_counter() - t, 2)
        res["steps"][name] = out
        print(f"[{args.worker}] {name}: {'ok' if out['ok'] else 'FAILED' if out['ok'] is False else 'skipped'}"
              f" ({out['s']} s)", flush=True)
        save()
    mark("end")
    save()
    return 0


# ---------------------------------------------------------------- the SIGSYS logger for the audit run

TRAP_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

static int log_fd = -1;
static char exe[80] = "?";
static long enosys_nr[2] = {-1, -1};

static char *put(char *p, unsigned long v) {
    char tmp[24]; int n = 0;
    do { tmp[n++] = '0' + v % 10; v /= 10; } while (v);
    while (n) *p++ = tmp[--n];
    return p;
}

/* SECCOMP_RET_TRAP: the call was not made; answer -errno as SECCOMP_RET_ERRNO would, and log it. */
static void on_sigsys(int sig, siginfo_t *si, void *ctx) {
    int saved = errno;
    ucontext_t *uc = ctx;
    long nr = si->si_syscall;
    long err = si->si_errno;
    if (err == 0) err = (nr == enosys_nr[0] || nr == enosys_nr[1]) ? ENOSYS : EPERM;  /* no RET_DATA given */
#if defined(__x86_64__)
    unsigned long a0 = uc->uc_mcontext.gregs[REG_RDI];
    uc->uc_mcontext.gregs[REG_RAX] = -err;
#elif defined(__aarch64__)
    unsigned long a0 = uc->uc_mcontext.regs[0];
    uc->uc_mcontext.regs[0] = -err;
#endif
    char buf[200], *p = buf;
    p = put(p, nr); *p++ = ' '; p = put(p, err); *p++ = ' '; p = put(p, a0); *p++ = ' ';
    p = put(p, getpid()); *p++ = ' ';
    for (char *q = exe; *q && p < buf + sizeof buf - 2; q++) *p++ = *q;
    *p++ = '\n';
    if (log_fd >= 0) write(log_fd, buf, p - buf);
    errno = saved;
}

__attribute__((constructor)) static void cuf_trap_init(void) {
    const char *path = getenv("CUF_TRAP_LOG");
    if (!path) return;
    if (getenv("CUF_ENOSYS_NR0")) enosys_nr[0] = atol(getenv("CUF_ENOSYS_NR0"));
    if (getenv("CUF_ENOSYS_NR1")) enosys_nr[1] = atol(getenv("CUF_ENOSYS_NR1"));
    log_fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    char link[512]; ssize_t n = readlink("/proc/self/exe", link, sizeof link - 1);
    if (n > 0) { link[n] = 0; char *b = strrchr(link, '/'); strncpy(exe, b ? b + 1 : link, sizeof exe - 1); }
    struct sigaction sa; memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigsys; sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSYS, &sa, NULL);
}
"""


def build_trap_lib(workdir, prebuilt=None):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc:
        src = os.path.join(workdir, "cuf_trap.c")
        lib = os.path.join(workdir, "cuf_trap.so")
        with open(src, "w") as f:
            f.write(TRAP_C)
        r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", lib, src], capture_output=True, text=True)
        if r.returncode == 0:
            return lib, f"built with {cc}"
        why = f"{cc} failed: {r.stderr[-300:]}"
    else:
        why = "no C compiler"
    if prebuilt and os.path.exists(prebuilt):
        return prebuilt, f"{why}; the prebuilt {prebuilt}"
    return None, why


def parse_trap_log(path, names):
    """The refused calls, per step: name, errno, process, count (and the socket families asked)."""
    per_step, step = {}, "before install"
    if not os.path.exists(path):
        return per_step
    with open(path) as f:
        for line in f:
            if line.startswith("## "):
                step = line[3:].strip()
                continue
            parts = line.split()
            if len(parts) < 5:
                continue
            nr, err, a0, _pid, exe = int(parts[0]), int(parts[1]), int(parts[2]), parts[3], parts[4]
            name = names.get(nr, f"#{nr}")
            if name == "socket":
                name = f"socket(family {a0})"
            key = f"{name} -> {errname(err)} in {exe}"
            per_step.setdefault(step, {})
            per_step[step][key] = per_step[step].get(key, 0) + 1
    return per_step


# ---------------------------------------------------------------- the orchestrator (unfiltered)

def versions():
    out = {"python": platform.python_version(), "kernel": platform.release(), "arch": platform.machine()}
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60)
        out["nvidia-smi"] = r.stdout.strip() or r.stderr.strip()[-200:]
    try:
        v = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                           capture_output=True, text=True, timeout=120).stdout.split()
        out["torch"], out["torch_cuda"] = v[0], v[1]
    except (IndexError, subprocess.SubprocessError):
        out["torch"] = None
    return out


def run_worker(mode, steps, env_extra, timeout):
    fd, result = tempfile.mkstemp(prefix=f"cuf-{mode}-", suffix=".json")
    os.close(fd)
    env = dict(os.environ, **env_extra)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--result", result]
    if steps:
        argv += ["--steps", *steps]
    t = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=env, timeout=timeout, capture_output=True, text=True)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", str(e)[-2000:]
    sys.stdout.write(tail if isinstance(rc, str) or rc else "")
    try:
        with open(result) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"steps": {}}
    res["worker_rc"] = rc
    res["wall_s"] = round(time.perf_counter() - t, 1)
    if rc != 0:
        res["worker_output_tail"] = tail
    return res


def regen_data():
    """Rebuild cuda_under_filter_syscalls.json from systemd-analyze and libseccomp (here, not on the device)."""
    text = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True, text=True, check=True).stdout
    groups, current = {}, None
    for line in text.splitlines():
        if line.startswith("@"):
            current = line.split()[0]
            groups[current] = []
        elif current and line.startswith("    ") and not line.strip().startswith("#") and line.strip():
            groups[current].append(line.strip())

    def expand(name, seen):
        out = set()
        for item in groups[name]:
            if item.startswith("@"):
                if item not in seen:
                    out |= expand(item, seen | {item})
            else:
                out.add(item)
        return out

    service, known = sorted(expand("@system-service", {"@system-service"})), sorted(expand("@known", {"@known"}))
    seccomp = ctypes.CDLL("libseccomp.so.2")
    seccomp.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]

    class Ver(ctypes.Structure):
        _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint)]

    seccomp.seccomp_version.restype = ctypes.POINTER(Ver)
    v = seccomp.seccomp_version().contents
    numbers = {arch: {name: seccomp.seccomp_syscall_resolve_name_arch(token, name.encode())
                      for name in sorted(set(service) | set(known))}
               for arch, token in AUDIT_ARCH.items()}
    systemd = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    data = {"source": {"systemd": systemd, "libseccomp": f"{v.major}.{v.minor}.{v.micro}",
                       "command": "systemd-analyze syscall-filter (groups expanded recursively)",
                       "numbers": "seccomp_syscall_resolve_name_arch(); negative: not on that architecture"},
            "system_service": service, "known": known, "numbers": numbers}
    with open(DATA, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"{DATA}: @system-service {len(service)} names, @known {len(known)}; {systemd}; "
          f"libseccomp {data['source']['libseccomp']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="the JSON record")
    ap.add_argument("--require-gpu", action="store_true", help="no GPU is a failure (on the lent machine)")
    ap.add_argument("--no-audit", action="store_true", help="skip the second run that logs refused calls")
    ap.add_argument("--trap-lib", help="a prebuilt cuf_trap.so for a machine with no C compiler")
    ap.add_argument("--steps", nargs="*", help="only these steps")
    ap.add_argument("--timeout", type=int, default=330, help="seconds for each filtered run")
    ap.add_argument("--regen-data", action="store_true")
    ap.add_argument("--worker", choices=["errno", "trap"], help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.regen_data:
        return regen_data()
    if args.worker:
        return worker(args)

    data = load_data()
    arch = platform.machine()
    if arch not in data["numbers"]:
        print(f"no syscall numbers for {arch}", file=sys.stderr)
        return 2
    nr, _allowed, _refused, counts = plan(data, arch)
    names = {n: s for s, n in nr.items()}
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    record = {"source": data["source"], "versions": versions(), "counts": counts,
              "baseline_controls_unfiltered": controls(nr, filtered=False),
              "expected_under_filter": EXPECTED_FILTERED}
    print(json.dumps(record["versions"]), flush=True)

    scratch = tempfile.mkdtemp(prefix="cuf-")
    caches = lambda tag: {"TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, tag, "inductor"),  # noqa: E731
                          "TRITON_CACHE_DIR": os.path.join(scratch, tag, "triton")}  # compile from nothing
    record["filtered"] = run_worker("errno", args.steps, caches("errno"), args.timeout)
    if args.out:  # kept if the audit run outlasts the caller's limit
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as out:
            json.dump(dict(record, verdict="incomplete: the audit run did not finish"), out, indent=1, default=str)

    if args.no_audit:
        record["audit"] = {"skipped": "--no-audit"}
    else:
        lib, how = build_trap_lib(scratch, args.trap_lib)
        if not lib:
            record["audit"] = {"skipped": how}
        else:
            log = os.path.join(scratch, "trap.log")
            env = dict(caches("trap"), LD_PRELOAD=lib, CUF_TRAP_LOG=log,
                       CUF_ENOSYS_NR0=str(nr["clone3"]), CUF_ENOSYS_NR1=str(nr["openat2"]))
            audit = run_worker("trap", args.steps, env, args.timeout)
            audit["trap_lib"] = how
            audit["refused_calls_by_step"] = parse_trap_log(log, names)
            record["audit"] = audit

    f = record["filtered"]
    have_gpu = f.get("gpu", {}).get("present", False)
    failed = [k for k, v in f.get("steps", {}).items() if v.get("ok") is False]
    problems = []
    if f.get("worker_rc") != 0:
        problems.append(f"the filtered worker exited {f.get('worker_rc')}")
    if not f.get("controls_as_expected"):
        problems.append("a control under the filter did not answer as expected")
    if failed:
        problems.append(f"failed under the filter: {failed}")
    if args.require_gpu and not have_gpu:
        problems.append(f"no GPU: {f.get('gpu', {}).get('detail')}")
    record["verdict"] = "PASS" if not problems else "FAIL: " + "; ".join(problems)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as out:
            json.dump(record, out, indent=1, default=str)
            out.write("\n")
    print_summary(record)
    return 0 if not problems else 1


def print_summary(r):
    f = r["filtered"]
    c = r["counts"]
    print(f"\narch {r['versions']['arch']}, kernel {r['versions']['kernel']}; systemd data: {r['source']['systemd']}")
    print(f"@system-service: {c['system_service_names']} names, {c['system_service_allowed']} allowed here, "
          f"{c['system_service_skipped_count']} not on this architecture; every other call EPERM "
          f"({c['known_outside_the_set']} of them in systemd's @known)")
    print(f"filters: {f.get('filters')}; status: {f.get('status_after_install')}")
    print("| control | unfiltered | filtered | expected |")
    print("| --- | --- | --- | --- |")
    for k, v in r["expected_under_filter"].items():
        if k in f.get("controls", {}):
            print(f"| {k} | {r['baseline_controls_unfiltered'].get(k, 'not run')} | {f['controls'][k]} | {v} |")
    print("| step | under the filter | s | audit run |")
    print("| --- | --- | ---: | --- |")
    a = r.get("audit", {})
    for k, v in f.get("steps", {}).items():
        state = lambda s: "skipped" if s.get("ok") is None else "ok" if s.get("ok") else "FAILED"  # noqa: E731
        aud = a.get("steps", {}).get(k)
        print(f"| {k} | {state(v)} | {v.get('s', '')} | {state(aud) if aud else '-'} |")
    m = f.get("steps", {}).get("matmul_bf16", {})
    if m.get("tflops"):
        print(f"matmul 8192 bf16: {m['tflops']} TFLOP/s ({m['ms_per_matmul']} ms)")
    if "refused_calls_by_step" in a:
        print("refused calls seen by the audit run (call -> errno in process: count):")
        for step, calls in a["refused_calls_by_step"].items():
            print(f"  {step}: {calls}")
    elif a:
        print(f"audit: {a.get('skipped')}")
    print(f"verdict: {r['verdict']}")


if __name__ == "__main__":
    sys.exit(main())
