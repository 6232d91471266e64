"""The `gpuwarden` console script: signals are held before the slow imports (earlysignals.py)."""

from .base import earlysignals


def main() -> int:
    earlysignals.hold()
    from .cli.main import main as cli_main

    return cli_main()
