"""Hook call sites in an unmodified mlx_lm.server.

mlx-lm has no plugin system. ``install`` swaps module globals of ``mlx_lm.server``
that it looks up at call time (``ModelProvider``, ``LRUPromptCache``,
``BatchGenerator``, ``ResponseGenerator``, ``_run_http_server``) for versions that
call the hooks and otherwise behave exactly as stock. No request handling is
copied; every stock endpoint keeps working.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import pluggy

from .plugins import activate, get_plugin_manager
from .routes import RouteRequest, RouteResponse, RouteTable

log = logging.getLogger("mlx_lm_hooks")


@dataclass
class RequestRecord:
    """What ``mlx_lm_request_finished`` receives."""

    model_key: tuple | None
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    finish_reason: str | None  # "stop", "length", "disconnect", "error" or None
    seconds: float


class _Installed:
    pm: pluggy.PluginManager | None = None
    stock: dict = {}
    routes: RouteTable | None = None
    cli_args = None


def _hook():
    return _Installed.pm.hook


def install(pm: pluggy.PluginManager) -> None:
    """Point mlx_lm.server at the hook call sites; calling it again only swaps ``pm``."""
    import mlx_lm.server as server

    _Installed.pm = pm
    routes = RouteTable()
    pm.hook.mlx_lm_register_routes(register=routes.register)
    _Installed.routes = routes
    if _Installed.stock:
        return
    _Installed.stock = {
        name: getattr(server, name)
        for name in (
            "ModelProvider",
            "LRUPromptCache",
            "BatchGenerator",
            "ResponseGenerator",
            "_run_http_server",
            "APIHandler",
        )
    }
    server.ModelProvider = _model_provider_class(_Installed.stock["ModelProvider"])
    server.LRUPromptCache = _prompt_cache
    server.BatchGenerator = _batch_generator
    server.ResponseGenerator = _response_generator_class(_Installed.stock["ResponseGenerator"])
    server._run_http_server = _run_http_server


def uninstall() -> None:
    """Restore stock mlx_lm.server (tests)."""
    import mlx_lm.server as server

    for name, value in _Installed.stock.items():
        setattr(server, name, value)
    _Installed.stock = {}
    _Installed.pm = None
    _Installed.routes = None


def _model_provider_class(stock):
    class ModelProvider(stock):
        def __init__(self, cli_args):
            super().__init__(cli_args)
            _Installed.cli_args = cli_args
            _hook().mlx_lm_server_start(cli_args=cli_args)

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            super()._load(model_path, adapter_path, draft_model_path)
            _hook().mlx_lm_model_loaded(
                model=self.model,
                tokenizer=self.tokenizer,
                model_key=self.model_key,
                draft_model=self.draft_model,
                cli_args=self.cli_args,
                model_provider=self,
            )

    return ModelProvider


def _prompt_cache(*args, **kwargs):
    cache = _hook().mlx_lm_prompt_cache(cli_args=_Installed.cli_args)
    if cache is None:
        cache = _Installed.stock["LRUPromptCache"](*args, **kwargs)
    return cache


def _batch_generator(model, **kwargs):
    generator = _hook().mlx_lm_batch_generator(model=model, kwargs=kwargs)
    if generator is None:
        generator = _Installed.stock["BatchGenerator"](model, **kwargs)
    return generator


def _response_generator_class(stock):
    class ResponseGenerator(stock):
        def generate(self, request, generation_args, progress_callback=None):
            ctx, responses = super().generate(request, generation_args, progress_callback)
            return ctx, self._observed(ctx, responses)

        def _observed(self, ctx, responses):
            start, generated, reason = time.perf_counter(), 0, None
            try:
                for r in responses:
                    generated += 1
                    reason = r.finish_reason or reason
                    yield r
            except GeneratorExit:
                reason = "disconnect"
                raise
            except Exception:
                reason = "error"
                raise
            finally:
                if reason is None and generated:
                    reason = "disconnect"
                record = RequestRecord(
                    model_key=self.model_provider.model_key,
                    prompt_tokens=len(ctx.prompt),
                    cached_tokens=max(ctx.prompt_cache_count, 0),
                    generated_tokens=generated,
                    finish_reason=reason,
                    seconds=time.perf_counter() - start,
                )
                try:
                    _hook().mlx_lm_request_finished(record=record)
                except Exception:
                    log.exception("a mlx_lm_request_finished hook failed")

    return ResponseGenerator


def _handler_class():
    stock = _Installed.stock["APIHandler"]

    class APIHandler(stock):
        def _plugin_route(self, method: str) -> bool:
            url = urlsplit(self.path)
            handler = _Installed.routes.get(method, url.path) if _Installed.routes else None
            if handler is None:
                return False
            body = b""
            if method == "POST":
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                response = handler(RouteRequest(method, url.path, url.query, body))
            except Exception:
                log.exception("plugin route %s %s failed", method, url.path)
                response = RouteResponse(500, {"error": "internal error in a plugin route"})
            payload = response.payload()
            self.send_response(response.status)
            self.send_header("Content-Type", response.content_type)
            self.send_header("Content-Length", str(len(payload)))
            for k, v in response.headers.items():
                self.send_header(k, v)
            self._set_cors_headers()
            self.end_headers()
            self.wfile.write(payload)
            return True

        def do_GET(self):
            if not self._plugin_route("GET"):
                super().do_GET()

        def do_POST(self):
            if not self._plugin_route("POST"):
                super().do_POST()

    return APIHandler


def _run_http_server(host, port, response_generator, server_class=None, handler_class=None):
    stock = _Installed.stock["_run_http_server"]
    kwargs = {"handler_class": _handler_class()}
    if server_class is not None:
        kwargs["server_class"] = server_class
    return stock(host, port, response_generator, **kwargs)


def serve(plugin_names: list[str], argv: list[str] | None = None, pm=None):
    """Run mlx_lm.server's own main() with the named plugins active."""
    import mlx_lm.server as server

    pm = pm or get_plugin_manager()
    activate(plugin_names, pm)
    install(pm)
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    # The startup shim may have wrapped main(); the original is what runs here.
    return getattr(server.main, "__wrapped__", server.main)()
