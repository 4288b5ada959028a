"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the API returns goes through `APIError`, so clients (the `openai` package
raises `BadRequestError`, `AuthenticationError`, ... from the status) see one shape: 400 for
bad parameters (including what FastAPI would answer with 422) and prompts longer than the
context, 401 for a bad API key, 404 for an unknown model or path, 503 when no route covers
the model or the queue is full.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from helixserve.errors import UserError

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client with `status` and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _TYPE_BY_STATUS.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _validation_to_api_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming the parameter (loc without 'body')."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request", code="invalid_request")
    err = errors[0]
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return APIError(400, "request body is not valid JSON", code="invalid_json")
    msg = str(err.get("msg", "invalid value"))
    if "input" in err and err.get("type") != "missing":
        msg += f" (got {err['input']!r})"[:300]
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_parameter")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(UserError)
    async def _user_error(_: Request, exc: UserError) -> JSONResponse:
        return APIError(400, str(exc), code="invalid_parameter").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_to_api_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        # still the OpenAI shape, so clients report it instead of failing to parse HTML/text
        return APIError(
            500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"
        ).response()
