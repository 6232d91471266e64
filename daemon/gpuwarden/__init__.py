"""gpuwarden: keeps NVIDIA inference GPUs tuned, watched and serving."""

__version__ = "0.1.0"
