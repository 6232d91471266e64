"""The command line's entry: the process's standard descriptors, the parser (registry.py), the command, and the
exit status of what went wrong in any of them."""

from __future__ import annotations

import json
import os
import sys

from ..base import earlysignals
from ..base.systemd import print_error
from ..base.yamlfile import InvalidConfig
from ..gpu import errors
from .registry import build_parser, find_commands
from ..base.exits import EX_CONFIG, EX_FAIL, EX_INTERRUPTED, EX_UNAVAILABLE


def open_standard_fds() -> None:
    """Started with stdin, stdout or stderr closed, the next open() would take that number, and the signal
    pipe or a socket would receive our prints. Point any closed one of fds 0-2 at /dev/null first."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def main(argv: list[str] | None = None) -> int:
    open_standard_fds()
    commands = find_commands()
    args = build_parser(commands).parse_args(argv)
    command = commands[args.command]
    if not command.keeps_held_signals:  # only the daemon's loop takes the signals held since start (earlysignals.py)
        earlysignals.release()
    try:
        return command.run(args)
    except InvalidConfig as exc:
        return _config_failure(exc, getattr(args, "json", False))
    except errors.GpuError as exc:
        print_error(f"gpuwarden: {exc}")
        return EX_UNAVAILABLE if isinstance(exc, errors.Unavailable) else EX_FAIL
    except KeyboardInterrupt:
        print_error("gpuwarden: interrupted")
        return EX_INTERRUPTED
    except BrokenPipeError:
        return EX_FAIL  # e.g. `gpuwarden plan | head`


def _config_failure(exc: InvalidConfig, as_json: bool) -> int:
    problems = exc.errors
    if as_json:
        print(json.dumps({"ok": False, "errors": [p.as_dict() for p in problems]}, indent=2))
    else:
        for problem in problems:
            print_error(str(problem))
    return EX_CONFIG


if __name__ == "__main__":
    sys.exit(main())
