"""OpenAI-format errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Every failure the gateway reports goes through `OpenAIError`, both as an HTTP response body and
as the `data:` payload of an SSE error event (the `openai` client raises `APIError` on either).
Messages are written for API clients: never a stack trace, never a secret.
"""

from __future__ import annotations

from http import HTTPStatus

from pydantic import ValidationError

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"


class OpenAIError(Exception):
    """An error to report to the API client as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        message = message.encode("utf-8", "replace").decode("utf-8")  # always encodable, whatever it quotes
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"OpenAIError({self.status}, {self.message!r}, code={self.code!r})"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def unsupported_parameter(param: str, why: str = "") -> OpenAIError:
    detail = f": {why}" if why else ""
    return OpenAIError(400, f"Unsupported parameter '{param}'{detail}.", param=param, code="unsupported_parameter")


def unrecognized_argument(param: str) -> OpenAIError:
    """A request parameter the API does not have (OpenAI's message for it)."""
    shown = param if len(param) <= 64 else f"{param[:64]}..."
    return OpenAIError(400, f"Unrecognized request argument supplied: {shown}", param=shown, code="unknown_parameter")


def context_length_exceeded(message: str, param: str = "messages") -> OpenAIError:
    return OpenAIError(400, message, param=param, code="context_length_exceeded")


def model_not_found(model: str) -> OpenAIError:
    shown = model if len(model) <= 256 else f"{model[:256]}..."
    return OpenAIError(
        404,
        f"The model `{shown}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def invalid_api_key(provided: bool) -> OpenAIError:
    if provided:
        message = "Incorrect API key provided."
    else:
        message = "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
    return OpenAIError(401, message, code="invalid_api_key")


def service_unavailable(message: str, code: str = "service_unavailable") -> OpenAIError:
    return OpenAIError(503, message, type=SERVER_ERROR, code=code)


def bad_gateway(message: str) -> OpenAIError:
    return OpenAIError(502, message, type=SERVER_ERROR, code="worker_failed")


def internal_error(message: str = "The server had an error while processing your request.") -> OpenAIError:
    return OpenAIError(500, message, type=SERVER_ERROR, code="internal_error")


def http_error(status: int, detail: str | None = None) -> OpenAIError:
    """For routing-level errors (404 route, 405 method, ...): OpenAI's shape, the HTTP phrase."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    kind = SERVER_ERROR if status >= 500 else (NOT_FOUND if status == 404 else INVALID_REQUEST)
    return OpenAIError(status, detail or phrase, type=kind, code=phrase.lower().replace(" ", "_"))


_TYPE_TAGS = frozenset({"body", "str", "int", "float", "bool", "dict", "list", "none", "json-or-python"})


def _is_type_tag(part: str) -> bool:
    """Pydantic puts union-member and validator tags in error locations; they are not parameters."""
    return part in _TYPE_TAGS or "[" in part or part.startswith(("function-", "tagged-union", "constrained-"))


def _loc(loc: tuple) -> str:
    """Pydantic's location tuple as OpenAI's `param`: messages.0.content -> messages[0].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_type_tag(str(part)):
            out += f".{part}" if out else str(part)
    return out


def _most_telling(errors: list[dict]) -> dict:
    """The first error, unless it is one union member's type mismatch and another member of the same
    parameter had the right type but a bad value: `prompt: [1, 2**32]` is "prompt[1] is too large",
    not "prompt should be a string"."""
    first = errors[0]
    if not first.get("type", "").endswith("_type"):
        return first
    field = tuple(first.get("loc", ()))[:1]
    for e in errors[1:]:
        if tuple(e.get("loc", ()))[:1] == field and not e.get("type", "").endswith(("_type", "missing")):
            return e
    return first


def from_validation_error(err: ValidationError) -> OpenAIError:
    """The most telling problem of a pydantic validation error, as a 400 naming the parameter."""
    first = _most_telling(err.errors(include_url=False))
    param = _loc(tuple(first.get("loc", ()))) or None
    kind = first.get("type", "")
    if kind == "missing":
        return invalid_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    message = str(first.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    return invalid_request(f"Invalid value for '{param}': {message}" if param else message, param, "invalid_value")
