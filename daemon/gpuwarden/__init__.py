"""gpuwarden: keeps NVIDIA inference GPUs tuned, watched and serving."""

__version__ = "0.2.0"
