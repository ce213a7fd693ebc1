"""`--api-key`: the OpenAI routes need `Authorization: Bearer KEY`; /health and /metrics stay open."""

from __future__ import annotations

import hmac

from services.api.errors import ApiError


class RequireApiKey:
    """ASGI middleware answering 401, with an OpenAI-style error, to /v1 requests without the key."""

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


def _guarded(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")
