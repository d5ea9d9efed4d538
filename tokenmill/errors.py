"""Typed errors. Each carries the HTTP status and OpenAI error type the server maps it to."""

from __future__ import annotations


def describe_error(e: BaseException) -> str:
    """One line for a log or a terminal: the message, or the type when the message is empty."""
    text = " ".join(str(e).split())
    return text if isinstance(e, TokenmillError) and text else f"{type(e).__name__}: {text}" if text else \
        type(e).__name__


class TokenmillError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(TokenmillError, ValueError):
    """Bad user input: a parameter out of range, a prompt that cannot fit, a malformed body."""

    status_code = 400
    error_type = "invalid_request_error"


class ConfigError(TokenmillError, ValueError):
    """Bad engine configuration (flags, environment, model files)."""

    status_code = 500
    error_type = "config_error"


class AuthenticationError(TokenmillError):
    status_code = 401
    error_type = "authentication_error"


class ModelNotFoundError(TokenmillError):
    status_code = 404
    error_type = "invalid_request_error"  # OpenAI's type and code

    def __init__(self, message: str, param: str | None = "model"):
        super().__init__(message, param=param, code="model_not_found")


class QueueFullError(TokenmillError):
    """Back-pressure: the waiting queue is at --max-queue-len."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after: int = 1, code: str = "queue_full"):
        super().__init__(message, code=code)
        self.retry_after = retry_after


class SLORejectedError(QueueFullError):
    """Back-pressure: `serve --slo` predicts the request would miss the SLO under the current load."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message, retry_after, code="slo_unattainable")


class ServiceUnavailableError(TokenmillError):
    """The server is loading, draining for shutdown, or its engine died."""

    status_code = 503
    error_type = "service_unavailable"


class EngineDeadError(TokenmillError):
    """The engine loop raised; in-flight requests fail with this."""

    status_code = 500
    error_type = "internal_error"


class EngineStepError(TokenmillError):
    """One engine step raised: the requests of its batch failed, the engine goes on."""

    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, request_ids: list[str]):
        super().__init__(message)
        self.request_ids = request_ids


class RequestTimeoutError(TokenmillError):
    status_code = 408
    error_type = "timeout"


class WorkerDiedError(TokenmillError):
    """A worker rank died or its collectives broke: the engine cannot go on (it reports itself dead)."""

    status_code = 500
    error_type = "internal_error"
