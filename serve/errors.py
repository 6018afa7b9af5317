"""Errors in OpenAI's shape, shared by every route: ``ApiError`` and the bodies and docs it is answered with."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from serve.schemas import ErrorResponse


class ApiError(Exception):
    """An error answered in OpenAI's shape; ``status`` 4xx for the client's fault, 5xx for ours."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                        headers=exc.headers)


# Documented on every generation route so clients (and the schema fuzzer) know the error shape.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {400: "Invalid request (malformed body, wrong types, limits, unsupported parameters)",
                       401: "Missing or wrong API key", 404: "Unknown model", 429: "Queue full (see Retry-After)",
                       503: "Loading, draining or engine down", 504: "Request timed out"}.items()
}
SSE_DOC = {"description": "JSON, or with `stream: true` server-sent events ending in `data: [DONE]`",
           "content": {"text/event-stream": {}}}
