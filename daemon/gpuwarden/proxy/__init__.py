"""The prefix-cache normalizing proxy: `gpuwarden proxy`, a child of its own in front of the serving engine.

normalize.py: the rules (pure functions on a parsed request); server.py: the aiohttp proxy; the limits on
clients: listener.py (the connection cap and each connection's deadlines), body.py (the body's size, encoding
and parse, within one memory budget), faults.py (client faults logged once a minute per kind); hold.py: requests
held while the engine is down, sent once it is back; dump.py and diff.py: the per-session request dumps and
`gpuwarden proxy diff`; command.py: the CLI; child.py: the daemon's supervised Program for it.
"""
