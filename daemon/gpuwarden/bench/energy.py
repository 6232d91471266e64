"""Energy per step: joules per output token and tokens per joule, with and without the idle draw.

The energy of a step is the GPUs' mean power (the watch's polls over the step's own seconds, summed over the
GPUs) times the step's duration: the trapezoid of NVML's power readings. NVML's total-energy counter
(nvmlDeviceGetTotalEnergyConsumption, mJ since the driver loaded, Volta and newer) is what the daemon's rate
uses; bench's polls come from /status, where the counter is read only every counters_interval_s, too seldom for a
step of seconds. tests/hardware/energy_readonly.py measures how far the two differ on a real card.

The idle draw is the GPUs' mean power over a few seconds before the first step, with no request in flight: the
energy above it is what serving cost, the rest the card would draw anyway. Where the draw did not rise above idle by
more than the readings can tell apart (ABOVE_IDLE_MIN_W, ABOVE_IDLE_MIN_SHARE), no per-token figure is given, only
the reason (NOT_ABOVE_IDLE): tokens over nearly nothing made 1.2e17 tok/J of GPUs that never served them.
"""

from __future__ import annotations


# The least rise of the mean draw above idle that is a figure, as watts per GPU and as a share of the step's draw,
# whichever is larger. A card's power reading comes in mW (the energy counter in mJ), but at a steady load it moves
# by about a percent from one poll to the next (the board's own sampling window, fans), and an idle card drifts by
# a watt or so as it warms: a smaller rise could be that alone, and tokens over it would be any number at all. A GPU
# that serves draws tens of watts above its idle, far above both.
ABOVE_IDLE_MIN_W = 1.0
ABOVE_IDLE_MIN_SHARE = 0.01
NOT_ABOVE_IDLE = ("the GPUs' draw did not rise above idle by more than the readings' resolution: not the server's "
                  "GPUs, or a load too light to measure")


def above_idle_measurable(watts: float, idle_w: float, gpus: int) -> bool:
    """The step's summed mean draw rose above the idle draw by more than the readings can tell apart."""
    return watts - idle_w >= max(ABOVE_IDLE_MIN_W * max(gpus, 1), ABOVE_IDLE_MIN_SHARE * watts)


def gpu_watts(gpus: list[dict]) -> float | None:
    """The summed mean power of the step's GPUs; None when none reported power."""
    watts = [g["power_w_mean"] for g in gpus if g.get("power_w_mean") is not None]
    return sum(watts) if watts else None


def step_energy(step: dict, idle_w: float | None) -> dict:
    """The energy figures of one summarized step (sweep.summarize_step plus its "gpus")."""
    watts = gpu_watts(step.get("gpus") or [])
    tokens, duration = step.get("output_tokens") or 0, step.get("duration_s") or 0.0
    out = {"gpu_watts_mean": watts, "energy_j": None, "joules_per_token": None, "tokens_per_joule": None,
           "joules_per_token_above_idle": None, "tokens_per_joule_above_idle": None, "energy_note": None}
    if watts is None or duration <= 0:
        return out
    energy = watts * duration
    out["energy_j"] = energy
    reporting = [g for g in step.get("gpus") or [] if g.get("power_w_mean") is not None]
    if idle_w is not None and tokens and not above_idle_measurable(watts, idle_w, len(reporting)):
        # Tokens were served and these GPUs drew no more than idle: not the figure of what served them, with or
        # without the idle draw (the draw itself is still a reading, and stays).
        out["energy_note"] = NOT_ABOVE_IDLE
        return out
    if tokens and energy > 0:
        out["joules_per_token"], out["tokens_per_joule"] = energy / tokens, tokens / energy
    if idle_w is not None and tokens:
        above = (watts - idle_w) * duration
        out["joules_per_token_above_idle"], out["tokens_per_joule_above_idle"] = above / tokens, tokens / above
    return out
