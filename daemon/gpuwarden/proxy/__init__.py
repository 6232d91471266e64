"""The prefix-cache normalizing proxy: `gpuwarden proxy`, a child of its own in front of the serving engine.

normalize.py: the rules (pure functions on a parsed request); server.py: the aiohttp proxy; dump.py and
diff.py: the per-session request dumps and `gpuwarden proxy diff`; command.py: the CLI; child.py: the
daemon's supervised Program for it.
"""
