"""Synthetic requests: prompts of about --input-len tokens, --output-len tokens out (max_tokens, and
ignore_eos where the server accepts it), each prompt different from the first word on, so that no request is
served from another's prefix cache.

Prompt length in tokens needs the model's tokenizer, which the client does not have: a calibration request
reads how many tokens the server counts for a known number of words (usage.prompt_tokens), and every prompt is
then sized from that ratio. The mean input tokens the server counted is reported beside the step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = ("gpu clock power memory token model serve batch cache layer tensor stream kernel warp block thread "
         "queue sample prompt decode prefill latency bandwidth watt lock board fan rack node host driver").split()
CALIBRATION_WORDS = 200


@dataclass(frozen=True)
class Workload:
    model: str
    api: str  # "completions" or "chat"
    input_len: int
    output_len: int
    ignore_eos: bool = True
    tokens_per_word: float = 1.0  # from the calibration request
    seed: int = 0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def prompt(self, n: int, words: int | None = None) -> str:
        """Request n's prompt: a number no other request starts with, then random words."""
        rng = random.Random(self.seed * 1_000_003 + n)
        count = words if words is not None else max(1, round(self.input_len / self.tokens_per_word) - 1)
        return f"{n}: " + " ".join(rng.choice(WORDS) for _ in range(count))

    def payload(self, n: int, max_tokens: int | None = None, words: int | None = None) -> dict:
        # No temperature: the server's default sampling, as vLLM's own benchmark leaves it since 0.32.
        body: dict = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                      "max_tokens": max_tokens or self.output_len}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt(n, words)}]
        else:
            body["prompt"] = self.prompt(n, words)
        return body
