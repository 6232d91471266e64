"""Synthetic requests: prompts of --input-len tokens, --output-len tokens out (max_tokens, and ignore_eos where
the server accepts it), each prompt different from the others within its first words, so that no request is
served from another's prefix cache beyond those.

Prompt length in tokens needs the model's tokenizer, which the client does not have. Where the server has
/tokenize (vLLM, SGLang), the calibration asks it how many tokens each word of the vocabulary below takes, with
its leading space, and checks on a sample that a prompt's count is the sum of its words' (tokenizers split on
spaces before merging): every prompt is then built to exactly --input-len tokens, as vLLM's own benchmark sizes
its prompts. Elsewhere a calibration request reads how many tokens the server counts for a known number of words
(usage.prompt_tokens), and prompts are sized from that ratio. The mean input tokens the server counted is
reported beside the step either way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = ("gpu clock power memory token model serve batch cache layer tensor stream kernel warp block thread "
         "queue sample prompt decode prefill latency bandwidth watt lock board fan rack node host driver").split()
CALIBRATION_WORDS = 200
MARK_WORDS = 3  # request n's first words: n in base len(WORDS), so prompts differ within them


@dataclass(frozen=True)
class Workload:
    model: str
    api: str  # "completions" or "chat"
    input_len: int
    output_len: int
    ignore_eos: bool = True
    tokens_per_word: float = 1.0  # from the calibration request
    seed: int = 0
    word_tokens: tuple[int, ...] | None = None  # tokens of " " + WORDS[i], from /tokenize: exact prompt lengths
    special_tokens: int = 0  # what the server adds to every prompt (BOS)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def prompt(self, n: int, words: int | None = None) -> str:
        """Request n's prompt: words that name n first, then random words."""
        rng = random.Random(self.seed * 1_000_003 + n)
        chosen = _mark(n)
        if words is None and self.word_tokens is not None:
            return " " + " ".join(self._fill(chosen, rng))
        count = words if words is not None else max(1, round(self.input_len / self.tokens_per_word) - len(chosen))
        return " " + " ".join(chosen + [rng.choice(WORDS) for _ in range(count)])

    def _fill(self, chosen: list[str], rng: random.Random) -> list[str]:
        """chosen, then random words until the prompt is input_len tokens (or as close as the words allow)."""
        size = dict(zip(WORDS, self.word_tokens))
        left = self.input_len - self.special_tokens - sum(size[w] for w in chosen)
        longest = max(size.values())
        while left > 0:
            fits = [w for w in WORDS if size[w] <= left] if left < longest else WORDS
            if not fits:
                break
            word = rng.choice(fits)
            chosen.append(word)
            left -= size[word]
        return chosen

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


def _mark(n: int) -> list[str]:
    """n as MARK_WORDS (or more) words: digits in base len(WORDS), distinct for distinct n."""
    digits, n = [], abs(n) * 2 + (n < 0)  # the calibration's negative ids get marks of their own
    while n or len(digits) < MARK_WORDS:
        n, digit = divmod(n, len(WORDS))
        digits.append(WORDS[digit])
    return digits
