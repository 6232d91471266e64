"""Energy per step: joules per output token and tokens per joule, with and without the idle draw.

The energy of a step is the GPUs' mean power (the watch's polls over the step's own seconds, summed over the
GPUs) times the step's duration: the trapezoid of NVML's power readings. NVML's total-energy counter
(nvmlDeviceGetTotalEnergyConsumption, mJ since the driver loaded, Volta and newer) is what the daemon's rate
uses; bench's polls come from /status, where the counter is read only every counters_interval_s, too seldom for a
step of seconds. tests/hardware/energy_readonly.py measures how far the two differ on a real card.

The idle draw is the GPUs' mean power over a few seconds before the first step, with no request in flight: the
energy above it is what serving cost, the rest the card would draw anyway.
"""

from __future__ import annotations


def gpu_watts(gpus: list[dict]) -> float | None:
    """The summed mean power of the step's GPUs; None when none reported power."""
    watts = [g["power_w_mean"] for g in gpus if g.get("power_w_mean") is not None]
    return sum(watts) if watts else None


def step_energy(step: dict, idle_w: float | None) -> dict:
    """The energy figures of one summarized step (sweep.summarize_step plus its "gpus")."""
    watts = gpu_watts(step.get("gpus") or [])
    tokens, duration = step.get("output_tokens") or 0, step.get("duration_s") or 0.0
    out = {"gpu_watts_mean": watts, "energy_j": None, "joules_per_token": None, "tokens_per_joule": None,
           "joules_per_token_above_idle": None, "tokens_per_joule_above_idle": None}
    if watts is None or duration <= 0:
        return out
    energy = watts * duration
    out["energy_j"] = energy
    if tokens and energy > 0:
        out["joules_per_token"], out["tokens_per_joule"] = energy / tokens, tokens / energy
    if idle_w is not None and tokens:
        above = (watts - idle_w) * duration
        if above > 0:
            out["joules_per_token_above_idle"], out["tokens_per_joule_above_idle"] = above / tokens, tokens / above
    return out
