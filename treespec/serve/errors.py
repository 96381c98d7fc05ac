"""How every error is answered: OpenAI's body, {"error": {"message", "type", "param", "code"}},
whatever raised it (`ERROR_HANDLERS`, which `create_app` installs). A pydantic error's location
becomes the `param` (`error_loc`); a ValueError from treespec becomes a 400 naming the field
(`bad_request`)."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.requests import Request as HTTPRequest
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import ServeError, client_message, error_body, error_param

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def error_loc(loc) -> str | None:
    """A pydantic error location as a `param`: "messages[0].role", "tree.width". Union types
    add their member types to the location (prompt -> "list[int]" -> 0); those are left out."""
    parts = [x for x in loc if x != "body"]
    if not parts:
        return None
    param = str(parts[0])
    for x in parts[1:]:
        if isinstance(x, int):
            param += f"[{x}]"
        elif isinstance(x, str) and x.isidentifier() and x.islower() and x not in _TYPE_TAGS:
            param += f".{x}"
    return param


def bad_request(e: ValueError, field: str) -> ServeError:
    message = str(e)
    return ServeError(400, client_message(message), param=error_param(message, field))


def error_response(e: ServeError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def on_serve_error(request: HTTPRequest, e: ServeError):
    if e.status == 400 or e.status == 404:
        request.app.state.server.metrics.reject(e.status)
    return error_response(e)


async def on_validation_error(request: HTTPRequest, e: RequestValidationError):
    request.app.state.server.metrics.reject(400)
    errors = e.errors()  # a body's fields (`Server.parse` answers for the body itself)
    first = errors[0] if errors else {}
    param = error_loc(first.get("loc", ()))
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid body")
    if first.get("type") == "missing":
        message = f"{param} is required"
    return error_response(ServeError(400, message, param=param))


async def on_http_error(request: HTTPRequest, e: StarletteHTTPException):
    kind = "not_found" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)


async def on_error(request: HTTPRequest, e: Exception):
    return JSONResponse(error_body(f"{type(e).__name__}: {e}", "server_error"), status_code=500)


ERROR_HANDLERS = (
    (ServeError, on_serve_error),
    (RequestValidationError, on_validation_error),
    (StarletteHTTPException, on_http_error),
    (Exception, on_error),
)
