"""Running the serving engine (vLLM, SGLang) under gpuwarden: engines, profiles, lint, the command, the
supervisor and the engine's metrics."""
