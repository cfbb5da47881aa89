"""The ``agents`` plugin: ``POST /v1/messages`` (and its ``count_tokens``) and
``POST /v1/responses``.

``--plugin agents`` serves them over stock's prompt cache; ``--plugin radix`` serves them
too (over the radix pool), and naming both is the same as naming radix. The handlers are
module functions, so the two plugins register the very same ones (a no-op the second time).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from mlx_lm_hooks.hookspecs import hookimpl
from mlx_lm_hooks.routes import RouteRequest, RouteResponse
from mlx_lm_hooks.server import GenerationFailed, context_length

from ..config import Config, ConfigError, exit_with_usage_error, load_config, set_log_level
from . import fields as f
from . import generation as g
from . import messages, responses

log = logging.getLogger("mlx_radix.agents")


@dataclass(frozen=True)
class Options:
    """The ``agents.*`` settings (config.py), as the routes read them."""

    billing_header: bool = False


options = Options()


def configure(config: Config) -> None:
    """Read the ``agents.*`` settings: at server start, by whichever plugin serves the
    routes (radix with its own configuration, agents alone with the file's and env's)."""
    global options
    options = Options(billing_header=config["agents.billing_header"])


def _body(request: RouteRequest) -> object:
    try:
        return json.loads(request.body or b"null")
    except ValueError as e:  # also bad UTF-8
        raise f.ApiError(400, f"the request body is no JSON: {e}", "body") from e


def _serve(request: RouteRequest, api, read) -> RouteResponse:
    """Parse, start, answer: ``api`` is the messages or responses module, ``read`` its
    reading of a body into a conversation."""
    try:
        body = _body(request)
        conversation = read(body)
        streamed = body.get("stream") is True
        turn = g.start(request.generator, conversation)
    except f.ApiError as e:
        return RouteResponse(e.status, api.error_body(e))
    except Exception as e:  # the client gets the API's error shape, the log the traceback
        log.exception("%s failed", request.path)
        error = f.ApiError(500, f"internal error: {type(e).__name__}: {e}")
        return RouteResponse(500, api.error_body(error))
    if streamed:

        def stream(write) -> None:
            try:
                api.stream(turn, conversation, write)
            except (BrokenPipeError, ConnectionResetError):
                raise  # the client hung up: the host logs it
            except Exception as e:
                log.exception("%s failed mid-stream", request.path)
                write(api.error_event(_failure(e)))

        return RouteResponse(200, content_type="text/event-stream", stream=stream)
    try:
        return RouteResponse(200, api.answer(turn, conversation))
    except (BrokenPipeError, ConnectionResetError):
        raise  # the client hung up (mlx_lm_hooks' ClientGone): the host logs it
    except Exception as e:
        log.exception("%s failed", request.path)
        error = _failure(e)
        headers = {"Retry-After": str(error.retry_after)} if error.retry_after else {}
        return RouteResponse(error.status, api.error_body(error), headers=headers)


def _failure(error: Exception) -> f.ApiError:
    """What a client hears of a request that failed after it started."""
    if isinstance(error, GenerationFailed):
        failed = f.ApiError(503, str(error))
        failed.retry_after = getattr(error, "retry_after", None)  # Overloaded's
        return failed
    return f.ApiError(500, f"internal error: {type(error).__name__}: {error}")


# A count_tokens body is tokenized on its handler's thread: at most this many bytes a token
# of the model's context (and at least COUNT_MIN_BYTES) are read. A 9 MB body took 19.5 s of
# a thread on this CPU; a body past the bound holds far more than the context takes.
COUNT_BYTES_PER_TOKEN = 32
COUNT_MIN_BYTES = 1 << 20


def count_limit(model) -> int:
    """The largest count_tokens body read for ``model``, in bytes."""
    context = context_length(model) if model is not None else None
    return max(COUNT_MIN_BYTES, (context or 0) * COUNT_BYTES_PER_TOKEN)


def count_tokens_route(request: RouteRequest) -> RouteResponse:
    provider = getattr(request.generator, "model_provider", None)
    limit = count_limit(getattr(provider, "model", None))
    if len(request.body or b"") > limit:
        error = f.ApiError(
            413,
            f"a count_tokens request of {len(request.body)} bytes holds more than this model's "
            f"context takes; at most {limit} bytes are counted",
            "body",
            "request_too_large",
        )
        return RouteResponse(413, messages.error_body(error))
    try:
        conversation = _messages_conversation(_body(request), counting=True)
        return RouteResponse(200, messages.count_tokens(conversation, request.generator))
    except f.ApiError as e:
        return RouteResponse(e.status, messages.error_body(e))


def _messages_conversation(body: object, counting: bool = False) -> g.Conversation:
    return messages.conversation(body, counting, billing_header=options.billing_header)


def messages_route(request: RouteRequest) -> RouteResponse:
    return _serve(request, messages, _messages_conversation)


def responses_route(request: RouteRequest) -> RouteResponse:
    return _serve(request, responses, responses.conversation)


def register_routes(register) -> None:
    register("POST", "/v1/messages", messages_route)
    register("POST", "/v1/messages/count_tokens", count_tokens_route)
    register("POST", "/v1/responses", responses_route)


class AgentsPlugin:
    # First: where radix is active too, its configuration (with `mlx-radix serve`'s flags and
    # --config) is read after this one and is the one kept.
    @hookimpl(tryfirst=True)
    def mlx_lm_server_start(self, cli_args):
        try:
            config = load_config()
        except ConfigError as e:
            exit_with_usage_error(str(e))
        configure(config)
        set_log_level(config["log_level"])  # where agents is active without radix too

    @hookimpl
    def mlx_lm_register_routes(self, register):
        register_routes(register)


plugin = AgentsPlugin()
