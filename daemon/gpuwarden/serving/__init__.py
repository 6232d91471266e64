"""Running vLLM under gpuwarden: profiles, lint, the command, the supervisor and its metrics."""
