"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the status
code that says whose fault it is (400 the request's, 404 no such route or model, 429 the queue is
full, 503 shutting down, 500 the server's)."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger("jaxmtp.serve")

# The error type OpenAI's API gives each status code.
TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error"}


class ApiError(Exception):
    """A request refused (or failed) with this status; param names the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def _place(loc) -> str:
    """A pydantic error location after "body" -> "messages[0].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_error(errors: list[dict]) -> ApiError:
    """The first of FastAPI's request validation errors as a 400 naming the field (param: the
    request's top-level field; the message says where inside it)."""
    e = errors[0]
    loc = tuple(e.get("loc", ()))
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON ({detail})".replace(" ()", ""), code="invalid_json")
    if loc[:1] == ("body",):
        loc = loc[1:]
    if not loc:
        return ApiError(400, "the request body must be a JSON object with the request's fields", code="invalid_body")
    place = _place(loc)
    if e.get("type") == "extra_forbidden":
        return ApiError(400, f"{place}: unknown field; this server does not take it (see docs/serving.md for the "
                             "fields it takes)", param=str(loc[0]), code="unknown_field")
    message = re.sub(r"^Value error, ", "", e.get("msg", "invalid value"))
    return ApiError(400, f"{place}: {message}", param=str(loc[0]), code="invalid_value")


def install(app: FastAPI):
    """Makes every error the app answers OpenAI-shaped."""

    @app.exception_handler(ApiError)
    async def _api(request: Request, error: ApiError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        return validation_error(list(error.errors())).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException):
        return ApiError(error.status_code, str(error.detail), headers=getattr(error, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, error: Exception):
        logger.exception("error while answering %s %s", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(error).__name__}: {error}").response()
