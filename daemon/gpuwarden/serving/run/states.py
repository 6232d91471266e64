"""A supervised child's states (serving/run/supervisor.py has the table of which may follow which). HELD: stopped
for its GPU, which must not serve until its action is done (serving/run/holding.py), neither restarted nor FATAL."""

STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL, HELD = (
    "STOPPED", "STARTING", "RUNNING", "BACKOFF", "STOPPING", "EXITED", "FATAL", "HELD")
STATES = (STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL, HELD)
