"""`--api-key`: every route needs `Authorization: Bearer KEY` but /health and /metrics, which probes
and scrapers call without one (the utility routes too: /tokenize parses whatever body it is sent).

With several keys each is a tenant: a request carries its tenant (`scope["state"]["tenant"]`),
which salts its prefix-cache keys, so that no tenant's prompts can be found in the cache by another.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from services.api.errors import ApiError
from services.api.messages import error_response as anthropic_error


class RequireApiKey:
    """ASGI middleware answering 401 to requests without a key: `Authorization: Bearer KEY`, or Anthropic's
    `x-api-key: KEY`; the error in OpenAI's shape, or in Anthropic's on its Messages route."""

    def __init__(self, app: ASGIApp, api_keys: list[str], admin_key: str | None = None):
        self.app = app
        keys = [*api_keys, *([admin_key] if admin_key else [])]
        # Each key's expected header, its tenant (none with one key, a digest of the key with several), and
        # whether it is the admin's.
        self.expected = [
            (f"Bearer {key}".encode(), tenant_of(key) if len(keys) > 1 else "", key == admin_key) for key in keys
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _guarded(scope["path"]):
            found = self._tenant(scope["headers"])
            if found is None:
                error = ApiError(
                    "a valid API key is needed: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    status=401,
                    code="invalid_api_key",
                )
                response = anthropic_error(error) if scope["path"].startswith("/v1/messages") else error.response()
                await response(scope, receive, send)
                return
            state = scope.setdefault("state", {})
            state["tenant"], state["admin"] = found
        await self.app(scope, receive, send)

    def _tenant(self, headers: list[tuple[bytes, bytes]]) -> tuple[str, bool] | None:
        """The tenant of the request's key and whether it is the admin's, or None without a valid key (every key
        is compared)."""
        sent = [value for name, value in headers if name == b"authorization"]
        sent += [b"Bearer " + value for name, value in headers if name == b"x-api-key"]
        found = None
        for expected, tenant, admin in self.expected:
            if len(sent) == 1 and hmac.compare_digest(sent[0], expected):
                found = (tenant, admin)
        return found


def tenant_of(key: str) -> str:
    return "tenant-" + hashlib.sha256(key.encode()).hexdigest()[:16]


OPEN_PATHS = frozenset({"/health", "/metrics"})


def _guarded(path: str) -> bool:
    return path not in OPEN_PATHS
