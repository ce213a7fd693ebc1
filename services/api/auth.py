"""`--api-key`: every route needs `Authorization: Bearer KEY` but /health and /metrics, which probes
and scrapers call without one (the utility routes too: /tokenize parses whatever body it is sent)."""

from __future__ import annotations

import hmac

from services.api.errors import ApiError


class RequireApiKey:
    """ASGI middleware answering 401, with an OpenAI-style error, to requests without the key."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and _guarded(scope["path"]) and not self._authorized(scope["headers"]):
            error = ApiError("a valid API key is needed: send it as 'Authorization: Bearer <key>'", status=401,
                             code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        sent = [value for name, value in headers if name == b"authorization"]
        return len(sent) == 1 and hmac.compare_digest(sent[0], self.expected)


OPEN_PATHS = frozenset({"/health", "/metrics"})


def _guarded(path: str) -> bool:
    return path not in OPEN_PATHS
