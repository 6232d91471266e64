"""A supervised child's states (serving/run/supervisor.py has the table of which may follow which). HELD: stopped
for its GPU, which must not serve until its action is done (serving/run/holding.py), neither restarted nor FATAL.
RESTING: stopped on purpose while no request comes (serve.idle: serving/run/resting.py), started again by the
proxy's word that one came."""

STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL, HELD, RESTING = (
    "STOPPED", "STARTING", "RUNNING", "BACKOFF", "STOPPING", "EXITED", "FATAL", "HELD", "RESTING")
STATES = (STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL, HELD, RESTING)
