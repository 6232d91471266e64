"""`gpuwarden doctor`: a one-shot, read-only preflight of the GPUs and the vLLM setup.

For people who do not run the daemon, and for the daemon's own start. Every
finding is one line with a severity and, where something is wrong, the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING

from ..gpu import throttle
from ..base.safetext import visible
from . import health
from .signals import RULES_BY_NAME
from .signals.health import RUNBOOK
from ..config import AlertSettings, Config
from ..gpu.base import ClockEventReason as R
from ..gpu.base import OFF_PCIE, PEER_PATHS, Gpu, GpuBackend, GpuSample, gpm_activity
from ..gpu.iommu import iommu_state
from ..tune.tunables import persistenced_fix, power_limit_is
from ..base.yamlfile import InvalidConfig

if TYPE_CHECKING:
    from ..serving.compose.command import ServeCommand

OK, INFO, WARNING, ERROR = "ok", "info", "warning", "error"
EXIT = {OK: 0, INFO: 0, WARNING: 1, ERROR: 2}
MIN_SM120_DRIVER = 580  # CUDA graphs work on SM120 from driver 580 on (the RTX PRO 4000 report)


@dataclass(frozen=True)
class Diagnosis:
    severity: str
    check: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        # one line on a terminal: a message may quote the engine's interpreter (serve.user's) or a server
        text = f"{self.severity.upper():7s} {self.check}: {self.message}" + (f" -> fix: {self.fix}" if self.fix else "")
        return visible(text)

    def as_dict(self) -> dict:
        return {"severity": self.severity, "check": self.check, "message": self.message, "fix": self.fix}


def exit_status(findings: list[Diagnosis]) -> int:
    return max((EXIT[f.severity] for f in findings), default=0)


def diagnose(config: Config, backend: GpuBackend, deep: bool = True) -> list[Diagnosis]:
    # One sample per GPU serves every line: a GPU's first sample reads the slow counters, GPM's among them
    taken = [(gpu, gpu.sample()) for gpu in backend.gpus()]
    findings = [_driver(backend, [s for _, s in taken])]
    persistenced = backend.persistenced_state()
    samples = []
    for gpu, s in taken:
        findings.append(_verdict(s, config))
        if not s.up:
            findings.append(Diagnosis(ERROR, f"GPU{s.index} present", f"{s.uuid} is lost: {s.error}",
                                    "check `dmesg` for Xid errors; reset the GPU or reboot"))
            continue
        samples.append(s)
        findings.append(_persistence(s, persistenced))
        chosen = _chosen_power_limit(config, s)
        findings.append(_clocks(s, config.alerts, chosen))
        findings.append(_power(s, chosen))
        findings.extend(_health(s, config.alerts))
        findings.extend(_nvlink(s))
        findings.append(_gpm(gpu, s))
    serving, command = _serving(config, backend, deep)
    findings.extend(_peer_path(command, samples))
    findings.extend(_tuning(config, backend))
    findings.extend(_power_budget(config, backend))
    findings.extend(serving)
    return findings


def _verdict(s: GpuSample, config: Config) -> Diagnosis:
    """The health model's verdict (watch/health.py) from this one sample: a one-shot run has no Xid events, so
    what it says is what the GPU itself reports (lost, the recovery action, memory, fabric, links)."""
    busy = throttle.is_busy(s, config.alerts.busy_utilization_pct)
    v = health.judge(s, health.Inputs(busy=busy), config.health.reboots_before_inspect)
    severity = {health.HEALTHY: OK, health.DEGRADED: WARNING, health.UNHEALTHY: ERROR}[v.state]
    return Diagnosis(severity, f"GPU{s.index} health", f"{v.state}, action {v.action_text}"
                     + (f": {'; '.join(v.reasons)}" if v.reasons else ""), RUNBOOK.get(v.action, ""))


def _health(s: GpuSample, alerts: AlertSettings) -> list[Diagnosis]:
    """The PCIe link and the memory, where the GPU reports them (nothing where it does not)."""
    h, out = s.health, []
    if h.link() is not None:
        replays = f", {plural(h.pcie_replays, 'replay')}" if h.pcie_replays is not None else ""
        text = f"{h.link()}{replays}"
        if not h.link_degraded:
            out.append(Diagnosis(OK, f"GPU{s.index} PCIe", text))
        elif throttle.is_busy(s, alerts.busy_utilization_pct):
            out.append(Diagnosis(WARNING, f"GPU{s.index} PCIe", f"{text}: below its generation or width under load",
                                 "reseat the card, check the riser and the slot's PCIe setting in the BIOS"))
        else:
            out.append(Diagnosis(INFO, f"GPU{s.index} PCIe", f"{text}: idle links train down to save power"))
    check = f"GPU{s.index} memory"
    if h.remap_failure or h.ecc_uncorrected:
        what = "a row could not be remapped" if h.remap_failure else f"{h.ecc_uncorrected} uncorrected ECC error(s)"
        out.append(Diagnosis(ERROR, check, what, "replace the card" if h.remap_failure else
                             "drain the GPU and reset it (or reboot); if it recurs, replace the card"))
    elif h.remap_pending or h.retire_pending:
        out.append(Diagnosis(WARNING, check, "a remapped row or retired page waits for a GPU reset",
                             "drain the GPU and reset it (or reboot)"))
    elif h.ecc_uncorrected is not None or h.remap_pending is not None or h.retired_pages is not None:
        rows = h.remapped_rows_correctable, h.remapped_rows_uncorrectable
        remapped = f", {sum(rows)} rows remapped" if None not in rows else ""
        out.append(Diagnosis(OK, check, f"no uncorrected ECC errors{remapped}"))
    return out


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _nvlink(s: GpuSample) -> list[Diagnosis]:
    """Each GPU's NVLink links and its NVSwitch fabric, where it has them."""
    h, out = s.health, []
    if h.nvlinks:
        up = [n for n in h.nvlinks if n.state in ("up", "sleep")]
        speed = max((n.speed_mbps for n in up if n.speed_mbps), default=None)
        peers = sorted({n.peer for n in up if n.peer}, key=lambda p: (len(p), p))
        errors = ", ".join(f"{kind} {count}" for kind, count in h.nvlink_errors().items())
        loose = [str(n.link) for n in h.nvlinks if n.state == "down" and not n.peer]
        text = f"{len(up)} of {len(h.nvlinks)} links up" + (f" at {speed} MB/s" if speed else "") + \
            (f" to {', '.join(peers)}" if peers else "") + (f"; errors since the driver loaded: {errors}"
                                                            if errors else "") + \
            (f"; link{'s' if len(loose) > 1 else ''} {', '.join(loose)} not connected" if loose else "")
        problems = h.nvlink_problems()
        if problems:
            out.append(Diagnosis(WARNING, f"GPU{s.index} NVLink", f"{'; '.join(problems)}: {text}",
                                 RULES_BY_NAME["nvlink_degraded"].hint))
        else:
            out.append(Diagnosis(OK, f"GPU{s.index} NVLink", text))
    if h.fabric is not None:
        if h.fabric_ready:
            out.append(Diagnosis(OK, f"GPU{s.index} fabric", "NVSwitch fabric registration completed"))
        else:
            what = f"completed with {h.fabric_error}" if h.fabric_error else h.fabric.replace("_", " ")
            out.append(Diagnosis(ERROR, f"GPU{s.index} fabric", f"NVSwitch fabric registration {what}: the GPU "
                                 "has no NVLink peers, and tensor parallelism cannot use it",
                                 RULES_BY_NAME["fabric_not_ready"].hint))
    return out


def _gpm(gpu: Gpu, s: GpuSample) -> Diagnosis:
    """Whether GPM works on this GPU, from the sample already taken: doctor pays for no GPM read of its own. Over
    one NVML sample GPM has only primed (a figure pairs two reads); the simulator's figures come at once."""
    check = f"GPU{s.index} GPM"
    why = gpu.gpm_unsupported()
    if why is not None:
        return Diagnosis(INFO, check, f"SM, tensor and DRAM activity not read: {why}")
    figures = gpm_activity(s.as_dict())
    if figures:
        util = f" at util {s.utilization_pct:.0f}%" if s.utilization_pct is not None else ""
        return Diagnosis(OK, check, f"{figures}{util}")
    return Diagnosis(OK, check, "works (a first sample read; SM, tensor and DRAM activity pair two reads "
                     "counters_interval_s apart: `gpuwarden status` shows them while the daemon runs)")


def _installed(installed, engine, written_against: dict[str, str]) -> list[Diagnosis]:
    """What the engine's interpreter has, and whether the lint rules are older than the engine."""
    from packaging.version import InvalidVersion, Version

    if not installed.known:
        return [Diagnosis(WARNING, f"{engine.title} installed", installed.describe(),
                          "rules keyed to versions then only warn; set serve.python to the engine's interpreter")]
    found = [Diagnosis(INFO, f"{engine.title} installed", installed.describe())]
    version = installed.version(engine.name)
    written = written_against.get(engine.name)
    try:
        newer = version is not None and written is not None and Version(version).release > Version(written).release
    except InvalidVersion:
        newer = False
    if newer:
        found.append(Diagnosis(WARNING, f"{engine.title} lint rules",
                               f"written against {engine.title} {written} at the newest; the installed {version} "
                               "is newer, so their advice may be stale",
                               "update gpuwarden, and add what you learn to /etc/gpuwarden/rules.d"))
    return found


def _metric_names(config: Config, engine) -> list[Diagnosis]:
    """The metric names gpuwarden reads, against the running engine's /metrics (nothing when it is not up)."""
    from ..base.httpget import HttpError
    from ..serving.compose.enginesock import configured_url
    from ..serving.probe.metrics import fetch

    try:
        served = fetch(configured_url(config.serve) + engine.metrics_path)  # its port or its socket
    except (HttpError, OSError, ValueError):  # not running, or not reachable from here: nothing to compare
        return []
    missing = engine.metric_names.missing(served)
    if missing:
        return [Diagnosis(WARNING, f"{engine.title} metrics", f"this {engine.title} no longer serves "
                          f"{'; '.join(missing)}: gpuwarden's serving metrics and stall alert go blind",
                          "update gpuwarden (engines/ names the metrics it reads)")]
    return [Diagnosis(OK, f"{engine.title} metrics", f"serves every metric gpuwarden reads ({len(served)} series)")]


def _peer_path(command: ServeCommand | None, samples: list[GpuSample]) -> list[Diagnosis]:
    """How each pair of GPUs talks (NVML's topology: gpu/nvml.py), in the engine's group when serving is
    prepared, else among all GPUs; with the IOMMU's state. Where the IOMMU translates and a pair talks over
    PCIe, the lint rule tp-pcie-iommu warns with its source when serving; here the line says where.
    command: the serving command _serving prepared (None: serving is off or could not be prepared)."""
    group = list(command.gpus) if command is not None else samples
    if len(group) < 2:
        return []
    by_kind: dict[str, list[tuple[GpuSample, GpuSample]]] = {}
    for a, b in combinations(group, 2):
        by_kind.setdefault(a.peer_paths.get(b.index, "unknown"), []).append((a, b))
    parts = []
    for kind, pairs in by_kind.items():
        name = PEER_PATHS.get(kind, "a path NVML did not say")
        if kind == "nvlink":  # links between the two, as nvidia-smi topo -m's NV6
            counts = sorted({sum(n.peer == f"GPU{b.index}" for n in a.health.nvlinks) for a, b in pairs})
            name += f" ({'-'.join(str(c) for c in counts if c)} links a pair)" if any(counts) else ""
        elif kind == "nvswitch":
            name += f" ({max(len(a.health.nvlinks) for a, _ in pairs)} links a GPU)"
        who = f"all {len(pairs)} pairs" if len(by_kind) == 1 else ", ".join(
            f"GPU{a.index}-GPU{b.index}" for a, b in pairs[:6]) + (f" +{len(pairs) - 6}" if len(pairs) > 6 else "")
        parts.append(f"{name} between {who}")
    iommu = next((s.iommu for s in group if s.iommu), None) or iommu_state()
    tp = command.engine.tensor_parallel_size(command.argv) if command is not None else None
    text = (f"tensor parallelism {tp}: " if tp else "") + "; ".join(parts) + f"; IOMMU {iommu}"
    crossing = [kind for kind in by_kind if kind not in OFF_PCIE]
    if iommu == "translating" and crossing:
        return [Diagnosis(INFO, "GPU peer paths", f"{text}: peer traffic over PCIe goes through it (lint rule "
                          "tp-pcie-iommu, with tensor parallelism)", "boot with iommu=pt (or the IOMMU off) and "
                          "ACS off in the BIOS")]
    return [Diagnosis(OK, "GPU peer paths", text)]


def _tuning(config: Config, backend: GpuBackend) -> list[Diagnosis]:
    """What the configured tuning sets on each GPU, setting by setting (the plan walks the settings table),
    or why a card cannot take it. Read-only: planning touches nothing."""
    from ..tune.tuning import make_plan

    try:
        plan = make_plan(backend, config)
    except InvalidConfig as exc:
        return [Diagnosis(ERROR, "tuning", str(problem), "change the value to one the card accepts")
                for problem in exc.errors]
    who = "`gpuwarden apply` or the service" if config.tuning.apply else "nothing (tuning.apply is false)"
    return [Diagnosis(INFO, f"GPU{gpu.index} tuning", f"set by {who}: " + "; ".join(
        a.describe().removeprefix(f"GPU {gpu.index} ") for a in gpu.actions))
        for gpu in plan.gpus if gpu.actions]


def _driver(backend: GpuBackend, samples: list[GpuSample]) -> Diagnosis:
    version = backend.driver_version()
    if version is None:
        return Diagnosis(WARNING, "driver", "NVML did not report a driver version")
    sm12x = [s.index for s in samples if (s.compute_capability or "").startswith("12.")]
    major = int(version.split(".")[0]) if version.split(".")[0].isdigit() else 0
    if sm12x and major < MIN_SM120_DRIVER:
        return Diagnosis(WARNING, "driver", f"driver {version} on SM12x GPUs {sm12x}",
                       f"install driver {MIN_SM120_DRIVER} or newer (CUDA graphs on SM120)")
    return Diagnosis(OK, "driver", f"driver {version}")


def _persistence(s: GpuSample, persistenced: str) -> Diagnosis:
    check = f"GPU{s.index} persistence"
    if s.persistence_mode is None:
        return Diagnosis(INFO, check, "persistence mode is not reported by this GPU")
    if persistenced == "running":
        if s.persistence_mode:
            return Diagnosis(OK, check, "persistence mode on (nvidia-persistenced runs)")
        # it keeps the driver loaded either way; some distributions run it with --no-persistence-mode
        return Diagnosis(INFO, check, "persistence mode off; nvidia-persistenced runs and keeps the driver loaded")
    where = "installed but not running" if persistenced == "stopped" else "not installed"
    if s.persistence_mode:
        return Diagnosis(INFO, check, f"persistence mode on, through NVML's setter, which the driver deprecates "
                         f"(nvidia-persistenced is {where})", persistenced_fix(persistenced))
    return Diagnosis(WARNING, check, f"persistence mode off and nvidia-persistenced is {where}: the driver "
                     "unloads between CUDA programs (gpuwarden falls back to NVML's deprecated setter without it)",
                     persistenced_fix(persistenced))


def _chosen_power_limit(config: Config, s: GpuSample) -> float | None:
    """The card's enforced limit where it is the one the config chose (tuning.power_limit_w, applied): a choice,
    reported as one and never as advice to undo it (the power_capped alert says the same)."""
    wanted = config.tuning.for_gpu(s.index, s.uuid).power_limit_w
    return wanted if config.tuning.apply and wanted is not None and power_limit_is(s.power_limit_w, wanted) else None


def _clocks(s: GpuSample, alerts: AlertSettings, chosen: float | None = None) -> Diagnosis:
    """The same question the alert rules ask (throttle.py), with the configured busy level and threshold;
    doctor knows no lock, so the threshold is taken against the maximum clock."""
    check = f"GPU{s.index} clocks"
    reasons = throttle.reasons(s)
    names = ",".join(reasons.names()) or "none"
    sm, top = s.sm_clock_mhz, s.max_sm_clock_mhz
    verdict = throttle.judge(sm, top, None, alerts.sm_clock_min, s)
    if verdict is None:
        return Diagnosis(INFO, check, "clocks are not reported by this GPU")
    busy = throttle.is_busy(s, alerts.busy_utilization_pct)
    now = f"SM {sm}/{top} MHz, memory {s.memory_clock_mhz} MHz, util {s.utilization_pct}%, P{s.performance_state}, " \
          f"reasons {names}"
    if busy and verdict.low and not verdict.held:
        return Diagnosis(ERROR, check, f"busy but stuck low with no throttle reason (below {verdict.limit:.0f} MHz, "
                       f"alerts.sm_clock_min_mhz {alerts.sm_clock_min}): {now}",
                       "lock the clocks: `sudo gpuwarden apply` with tuning.gpu_clocks: max")
    if busy and reasons & throttle.HARDWARE:
        return Diagnosis(ERROR, check, f"hardware slowdown: {now}", "check cooling and the power supply now")
    at_max = throttle.at_max_power_limit(s)
    if busy and reasons & R.SwPowerCap and not reasons & R.SwThermalSlowdown and at_max:
        return Diagnosis(OK, check, f"at its design power (SwPowerCap at its maximum limit, "
                       f"{s.power_limit_w:g} W): {now}")
    if busy and reasons & R.SwPowerCap and not reasons & R.SwThermalSlowdown and chosen is not None:
        return Diagnosis(OK, check, f"at the power limit chosen in tuning.power_limit_w ({chosen:g} W), which costs "
                       f"this clock: {now}")
    if busy and reasons & R.SwPowerCap and not reasons & R.SwThermalSlowdown:
        return Diagnosis(WARNING, check, f"power-capped below the card's maximum limit: {now}",
                       f"tuning.power_limit_w: {s.power_limit_max_w:g} adds {s.power_limit_max_w - s.power_limit_w:g} W"
                       if s.power_limit_max_w is not None and s.power_limit_w is not None else
                       "raise the power limit within its constraints (`gpuwarden plan`)")
    if busy and reasons & R.SwThermalSlowdown:
        return Diagnosis(WARNING, check, f"thermally throttled: {now}", "improve cooling or airflow")
    if not busy and verdict.low and (s.performance_state or 0) >= 8 and (s.compute_capability or "").startswith("12."):
        return Diagnosis(WARNING, check, f"idle and unlocked: {now}; headless SM12x cards stay at these clocks under "
                       "load", "lock the clocks: `sudo gpuwarden apply` with tuning.gpu_clocks: max")
    return Diagnosis(OK, check, now)


def _power(s: GpuSample, chosen: float | None = None) -> Diagnosis:
    check = f"GPU{s.index} power limit"
    low, high, limit = s.power_limit_min_w, s.power_limit_max_w, s.power_limit_w
    if limit is None or low is None or high is None:
        return Diagnosis(INFO, check, "the power limit is not reported by this GPU")
    text = f"{limit:g} W (allowed {low:g}-{high:g} W)"
    if chosen is not None:
        return Diagnosis(OK, check, f"{text}: chosen in tuning.power_limit_w")
    if limit < high - 0.5:
        return Diagnosis(WARNING, check, f"{text}: below the card's maximum",
                       f"tuning.power_limit_w: {high:g} if the GPU hits SwPowerCap")
    return Diagnosis(OK, check, text)


def _serving(config: Config, backend: GpuBackend, deep: bool) -> tuple[list[Diagnosis], ServeCommand | None]:
    """The serving checks, named after the engine ("vLLM profile", "SGLang flags"), and the command they
    prepared (None when serving is off or cannot be prepared)."""
    from ..serving.compose.engines import engine_for
    from ..serving.compose.prepare import prepare_serve

    engine = engine_for(config.serve.engine)
    title = engine.title if engine is not None else config.serve.engine
    if not config.serve.enabled:
        return [Diagnosis(INFO, title, f"serving is off (serve.enabled: false): {title} checks skipped")], None
    try:
        prepared = prepare_serve(config, backend, deep=deep)
    except InvalidConfig as exc:
        return [Diagnosis(ERROR, f"{title} profile", str(exc.errors[0]))], None
    found = [Diagnosis(OK, f"{title} profile", f"{prepared.command.profile.name} for {config.serve.model}")]
    if prepared.installed is not None:
        found += _installed(prepared.installed, prepared.command.engine, prepared.rules.written_against)
    found += _metric_names(config, prepared.command.engine)
    if prepared.home_note:
        found.append(Diagnosis(INFO, f"{title} home", prepared.home_note))
    for lint in prepared.findings:
        severity = {"error": ERROR, "info": INFO}.get(lint.severity, WARNING)
        found.append(Diagnosis(severity, f"{title} lint {lint.rule}",
                               f"{lint.message} [source: {lint.source}]", lint.fix))
    if prepared.command.role is not None:
        from ..serving.compose.nodes import preflight

        found += [Diagnosis(*line) for line in preflight(prepared.command.role, prepared.command.env)]
    if prepared.flags is not None:
        if prepared.flags.ok:
            found.append(Diagnosis(OK, f"{title} flags", f"{title} {prepared.flags.version} accepts the command"))
        else:
            found.append(Diagnosis(ERROR, f"{title} flags", f"{title} rejects the command: {prepared.flags.error}",
                                   "fix serve.args or the profile; `gpuwarden profiles show` prints it"))
    return found, prepared.command


def _power_budget(config: Config, backend: GpuBackend) -> list[Diagnosis]:
    """tuning.power_budget_w can be met: the cards' minimum limits fit it, and the split it would make now."""
    from ..tune import budget

    t = config.tuning
    if t.power_budget_w is None:
        return []
    gpus = backend.gpus()
    cards, lost = budget.cards_of(gpus, {g.index: g.sample() for g in gpus}, t.power_share, {})
    low, high = budget.minimum_w(cards), sum(c.max_w for c in cards)
    check = "power budget"
    if low > t.power_budget_w:
        return [Diagnosis(ERROR, check, f"{t.power_budget_w:g} W is below the GPUs' minimum limits, {low:g} W in all",
                          f"raise tuning.power_budget_w to at least {low:g} W")]
    alloc = (budget.static_split if lost else budget.split)(cards, t.power_budget_w)
    split = budget.describe(alloc, t.power_budget_w)
    if t.power_budget_w >= high:
        return [Diagnosis(INFO, check, f"{t.power_budget_w:g} W covers every GPU at its maximum ({high:g} W in all): "
                          f"it never holds a card back; split now: {split}")]
    return [Diagnosis(OK, check, f"{t.power_budget_w:g} W can be met ({low:g}-{high:g} W); split now: {split}")]
