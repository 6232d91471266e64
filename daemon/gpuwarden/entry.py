"""The `gpuwarden` console script: signals are held before the slow imports (earlysignals.py)."""

from . import earlysignals


def main() -> int:
    earlysignals.hold()
    from .cli import main as cli_main

    return cli_main()
