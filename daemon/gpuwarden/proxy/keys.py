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

__all__ = ["ENV", "KEYED", "KEYLESS", "KEYLESS_PATHS", "ApiKey"]
KEYLESS_PATHS = frozenset({"/ping", "/version"})  # liveness and version, which give nothing away


KEYED, KEYLESS = "keyed", "keyless"  # what lets_in lets in: a request with the key, or one that needs none


class ApiKey:
    def __init__(self, key: str):
        self._digest = hashlib.sha256(key.encode("utf-8")).digest()

    def lets_in(self, method: str, path: str, headers: Mapping[str, str]) -> str | None:
        """KEYED: the request carries the key as vLLM asks it (Authorization: Bearer KEY); KEYLESS: it needs none,
        being bodiless and a CORS preflight (an OPTIONS, as vLLM lets it by) or on a keyless path; None: refused.
        A keyless request with a body needs the key: keyless OPTIONS of 32 MiB each took the body budget while the
        engine was down (attacker 13), and so did a POST /ping of 1 MB (attacker 17). A keyless request is never
        held for an engine that is down (server.Proxy.forward): 300 keyless /ping took every place of hold_max, and
        the keyed requests of the outage got 503 at once (attacker 17's F1)."""
        scheme, _, given = (headers.get("Authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and self._is_key(given):
            return KEYED
        bodiless = headers.get("Content-Length", "0") in ("", "0") and "Transfer-Encoding" not in headers
        if bodiless and (path in KEYLESS_PATHS or method == "OPTIONS"):
            return KEYLESS
        return None

    def _is_key(self, given: str) -> bool:
        try:  # aiohttp decodes a header's bytes that are not UTF-8 as lone surrogates; the key has none
            raw = given.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate no byte made (attacker 17's F4: a 500 and a traceback, not a 401)
            return False
        return secrets.compare_digest(hashlib.sha256(raw).digest(), self._digest)
