"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx status."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class ApiError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
