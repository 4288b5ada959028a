"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the API returns goes through `APIError`, so clients (the `openai` package
raises `BadRequestError`, `AuthenticationError`, ... from the status) see one shape: 400 for
bad parameters (including what FastAPI would answer with 422) and prompts longer than the
context, 401 for a bad API key, 404 for an unknown model or path, 503 when no route covers
the model or the queue is full.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from helixserve.api.protocol import ParamError
from helixserve.errors import UserError

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
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
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        #: extra response headers (Retry-After on a 503 that will pass)
        self.headers = dict(headers or {})
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
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the union member it tried into loc: "str", "list[int]", "function-after[...]"
    return isinstance(part, str) and ("[" in part or part in _UNION_TAGS)


def _param_of(err: Mapping[str, Any]) -> str | None:
    loc = [str(part) for part in err.get("loc", ()) if part != "body" and not _is_union_tag(part)]
    return ".".join(loc) or None


def _validation_to_api_error(exc: RequestValidationError) -> APIError:
    """A 400 naming the parameter (loc without 'body' and without union member tags).

    Of several errors (a union reports one per member), the first that is not a plain type
    mismatch wins: `"prompt": [1, -5]` is a token id below 0, not "not a string"; when all
    are type mismatches of one parameter their messages are joined."""
    errors = list(exc.errors())
    if not errors:
        return APIError(400, "invalid request", code="invalid_request")
    err = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    kind = err.get("type")
    if kind == "json_invalid":
        return APIError(400, "request body is not valid JSON", code="invalid_json")
    param = _param_of(err)
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):  # a check across fields names its own parameter
        return APIError(400, f"{cause.param}: {cause}", param=cause.param,
                        code="invalid_parameter")
    if param is None:
        if kind == "missing":
            return APIError(400, "request body is missing: send a JSON object",
                            code="missing_body")
        return APIError(400, "request body must be a JSON object (Content-Type: "
                        "application/json)", code="invalid_body")
    msg = str(err.get("msg", "invalid value"))
    if kind.endswith("_type"):
        msgs = [str(e.get("msg")) for e in errors if _param_of(e) == param]
        msg = ", or ".join(dict.fromkeys(msgs))
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    if "input" in err and kind != "missing":
        got = repr(err["input"])
        msg += f" (got {got[:120]}{'...' if len(got) > 120 else ''})"
    return APIError(400, f"{param}: {msg}", param=param, code="invalid_parameter")


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
        if exc.status_code == 400:  # FastAPI could not read the body (e.g. not UTF-8)
            return APIError(400, f"request body is not valid JSON: {exc.detail}",
                            code="invalid_json").response()
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        # still the OpenAI shape, so clients report it instead of failing to parse HTML/text
        return APIError(
            500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"
        ).response()
