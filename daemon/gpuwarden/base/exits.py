"""The exit statuses of every command, in one table: sysexits.h where one fits, the shell's for an interrupt."""

EX_OK = 0
EX_FAIL = 1  # the work failed (a step, a tuning setting, a dump that cannot be read)
EX_NOT_RUNNING = 3  # as `systemctl status` says of an inactive unit; bench: nothing to compare
EX_UNAVAILABLE = 69  # NVML, the daemon or the server to ask is not there
EX_OSERR = 71  # an address that cannot be listened on
EX_NOPERM = 77  # not root, or no CAP_SYS_ADMIN
EX_CONFIG = 78  # bad arguments, config or model; the unit's RestartPreventExitStatus
EX_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
