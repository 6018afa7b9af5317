"""The API-key check every protected route shares (the admin key is serve/admin.py's)."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serve.errors import ApiError
from serve.settings import ServeSettings

if TYPE_CHECKING:
    from serve.service import Service

_bearer = HTTPBearer(auto_error=False, description="Needed only when the server sets VERL_SERVE_API_KEY.")


def service_of(request: Request) -> Service:
    return request.app.state.service


def check_bearer(settings: ServeSettings, given: str) -> None:
    """Raise the 401 unless ``given`` (the bearer token, "" when absent) is the configured key (constant time)."""
    key = settings.api_key
    if key is not None and not secrets.compare_digest(given.encode(), key.get_secret_value().encode()) and not \
            is_training_key(settings, given):
        raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                       type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def is_training_key(settings: ServeSettings, given: str) -> bool:
    """Whether ``given`` (a bearer token) is the configured ``training_api_key`` (constant time)."""
    key = settings.training_api_key
    return key is not None and secrets.compare_digest(given.encode(), key.get_secret_value().encode())


async def require_api_key(request: Request,
                          credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    # EdgeGuard already checked the key before the body was read; this keeps the OpenAPI security scheme.
    check_bearer(service_of(request).settings, credentials.credentials if credentials is not None else "")
