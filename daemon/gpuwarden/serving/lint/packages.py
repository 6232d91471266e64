"""What the engine's interpreter has installed, as the lint reads it: the answer of compose/installed.py's probe
(run there, as serve.user), or no answer (known False, every version unknown rather than absent).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

PACKAGES = {"vllm": "vLLM", "flashinfer": "FlashInfer", "torch": "torch", "sglang": "SGLang"}


@dataclass(frozen=True)
class Installed:
    """The answer. known False: no answer (why in error), and every version is unknown rather than absent."""

    python: str
    known: bool
    versions: Mapping[str, str | None] = field(default_factory=dict)  # module -> version; None: not installed
    torch_cuda: str | None = None
    env_names: frozenset[str] | None = None  # the VLLM_* names vllm/envs.py defines; None: not read
    error: str | None = None
    dirs: tuple[str, ...] = ()
    stamp: tuple = ()  # mtimes of the interpreter and dirs when answered: the cache's key
    toolkit: tuple[str, str] | None = None  # (CUDA toolkit version, where it was found); None: none found

    def version(self, module: str) -> str | None:
        return self.versions.get(module)

    def describe(self) -> str:
        if not self.known:
            return f"installed versions unknown: {self.error}"
        parts = []
        for module, title in PACKAGES.items():
            version = self.versions.get(module)
            if module == "sglang" and not version:
                continue  # named only where it is installed
            if module == "torch" and version:
                version += f" (CUDA {self.torch_cuda or 'none: a CPU build'})"
            parts.append(f"{title} {version or 'not installed'}")
        if self.toolkit:
            parts.append(f"CUDA toolkit {self.toolkit[0]} ({self.toolkit[1]})")
        return f"{', '.join(parts)} in {self.python}"

    def as_dict(self) -> dict:
        return {"python": self.python, "known": self.known, "versions": dict(self.versions),
                "torch_cuda": self.torch_cuda, "cuda_toolkit": list(self.toolkit) if self.toolkit else None,
                "error": self.error}


UNKNOWN = Installed("", known=False, error="not read")
