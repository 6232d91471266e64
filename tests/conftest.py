import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "etc" / "gpuwarden" / "gpuwarden.yaml"


@pytest.fixture
def write(tmp_path):
    """Write a file under tmp_path and return its path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    return _write


@pytest.fixture
def cli(capsys):
    """Run gpuwarden's main() in-process; return (status, stdout, stderr)."""
    from gpuwarden.cli import main

    def _run(*args: str):
        status = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return status, out, err

    return _run


def gpuwarden_cmd() -> list[str]:
    """The gpuwarden package installed in the interpreter running the tests."""
    return [sys.executable, "-m", "gpuwarden"]


def subprocess_env() -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1")
