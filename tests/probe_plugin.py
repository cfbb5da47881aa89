"""A plugin that implements every hook and records each call (run inside a test server)."""

import json
import os
import sys

from mlx_lm_hooks.hookspecs import hookimpl
from mlx_lm_hooks.routes import RouteResponse


class Probe:
    def __init__(self):
        self.calls: dict[str, list] = {}

    def _record(self, name, **info):
        self.calls.setdefault(name, []).append(info)

    @hookimpl
    def mlx_lm_server_start(self, cli_args):
        self._record("mlx_lm_server_start", port=cli_args.port)

    @hookimpl
    def mlx_lm_model_loaded(self, model, tokenizer, model_key, draft_model, cli_args):
        self._record("mlx_lm_model_loaded", model_key=list(model_key), layers=len(model.layers))

    @hookimpl
    def mlx_lm_prompt_cache(self, cli_args):
        self._record("mlx_lm_prompt_cache", size=cli_args.prompt_cache_size)

    @hookimpl
    def mlx_lm_batch_generator(self, model, kwargs):
        self._record("mlx_lm_batch_generator", kwargs=sorted(kwargs))

    @hookimpl
    def mlx_lm_http_front(self, cli_args):
        self._record("mlx_lm_http_front", port=cli_args.port)  # None: one process

    @hookimpl
    def mlx_lm_generation_idle(self):
        if "mlx_lm_generation_idle" not in self.calls:  # once is enough to know
            self._record("mlx_lm_generation_idle")

    @hookimpl
    def mlx_lm_request_finished(self, record):
        self._record(
            "mlx_lm_request_finished",
            prompt_tokens=record.prompt_tokens,
            generated=record.generated_tokens,
            reason=record.finish_reason,
        )

    @hookimpl
    def mlx_lm_server_stopped(self):
        # Nothing answers HTTP any more: the calls go to the file the test named.
        self._record("mlx_lm_server_stopped")
        path = os.environ.get("PROBE_CALLS_FILE")
        if path:
            with open(path, "w") as f:
                json.dump(self.calls, f)

    @hookimpl
    def mlx_lm_register_routes(self, register):
        self._record("mlx_lm_register_routes")
        register("GET", "/probe", lambda request: RouteResponse(200, self.calls))
        register(
            "POST", "/probe/echo", lambda request: RouteResponse(200, request.body, "text/plain")
        )
        register("GET", "/probe/boom", lambda request: 1 / 0)

    @hookimpl
    def mlx_lm_register_commands(self, cli):
        self._record("mlx_lm_register_commands")


def main() -> None:
    """``python probe_plugin.py [mlx_lm.server args]``: serve with only the probe active."""
    from mlx_lm_hooks.plugins import get_plugin_manager
    from mlx_lm_hooks.server import serve

    pm = get_plugin_manager()
    pm.register(Probe(), name="probe")
    serve([], sys.argv[1:], pm)


if __name__ == "__main__":
    main()
