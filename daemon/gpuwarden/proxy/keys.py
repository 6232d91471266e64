"""The engine's API key, checked at the proxy for every path. vLLM 0.32 checks its `--api-key` (VLLM_API_KEY) only
on the paths under /v1, /v2, /inference and /cohere (vllm/entrypoints/serve/middleware/authenticate.py,
GUARDED_PREFIX): POST /invocations (SageMaker's route, which runs a completion or a chat by its body), /tokenize,
/pooling, /score, /rerank and /classify answer without it. In front of such an engine the proxy asks the key on
every path but its own /health and /metrics and the engine's KEYLESS_PATHS, and refuses a request without it (401)
before a byte of its body is read or sent: the key the operator set means the engine serves nobody without it."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping

from ..serving.compose.apikey import KEY_ENV as ENV  # the daemon passes the engine's key there (proxy/child.py)

__all__ = ["ENV", "KEYLESS_PATHS", "ApiKey"]
KEYLESS_PATHS = frozenset({"/ping", "/version"})  # liveness and version, which give nothing away


class ApiKey:
    def __init__(self, key: str):
        self._digest = hashlib.sha256(key.encode("utf-8")).digest()

    def lets_in(self, method: str, path: str, headers: Mapping[str, str]) -> bool:
        """Whether a request may go on: it carries the key as vLLM asks it (Authorization: Bearer KEY), or needs
        none (a CORS preflight, an OPTIONS without a body, as vLLM lets it by; the keyless paths). An OPTIONS with a
        body needs the key: keyless ones of 32 MiB each took the body budget while the engine was down (attacker
        13)."""
        if path in KEYLESS_PATHS:
            return True
        if method == "OPTIONS" and headers.get("Content-Length", "0") in ("", "0") \
                and "Transfer-Encoding" not in headers:
            return True
        scheme, _, given = (headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(given.encode("utf-8")).digest(), self._digest)
