"""The ``radix`` plugin: what it does at each hook of mlx_lm.server."""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
import weakref
from collections import Counter
from typing import Any

from mlx_lm_hooks.hookspecs import hookimpl
from mlx_lm_hooks.routes import RouteRequest, RouteResponse
from mlx_lm_hooks.server import context_length

from ..agents import plugin as agents
from ..cache.prompt_cache import idle_stats
from ..config import Config, ConfigError, exit_with_usage_error, load_config, set_log_level
from ..engine import compiled_layers, compiled_pass, fused_projections, warmup
from ..engine.decode_path import idle_stats as idle_decode_stats
from ..engine.generator import RadixBatchGenerator
from ..engine.step_clock import StepClock
from ..memory import ranks
from ..memory.pool import UnsupportedModel, inspect_model
from . import metrics, mlx_lm_internals
from .pins import ROUTE_WAIT_SECONDS, prompt_tokens
from .server_cache import ServerPromptCache, mlx_memory_stats

log = logging.getLogger("mlx_radix")

# When the plugin loads: before the hooks change anything in mlx_lm.server.
mlx_lm_internals.check()


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is this machine's loopback (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    # An IPv6 address may carry a scope ("fe80::1%eth0"), which ipaddress does not parse.
    addresses = {info[4][0].split("%")[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def is_loopback_address(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def blas_notice() -> None:
    """On MLX's CPU backend, one line: the BLAS its matmuls use and how fast it is, a warning
    with what to do when that is the slow reference BLAS."""
    import mlx.core as mx
    from mlx_lm_hooks import blas

    if mx.default_device() != mx.cpu:
        return
    # The reference BLAS takes ~45 ms a run (6 GFLOP/s): ~0.15 s in all. OpenBLAS's runs vary
    # from 1 to 25 ms here (its threads wait for a busy core): the budget buys several.
    n = 512
    gflops = blas.measure(n, budget_s=0.1)
    library, advice = blas.describe(blas.preload())
    line = f"CPU BLAS: {library}, {gflops:.1f} GFLOP/s ({n}x{n} float32 matmul)"
    if advice:
        log.warning("%s; %s", line, advice)
    else:
        log.info("%s", line)


class RadixPlugin:
    def __init__(self):
        self.cli_overrides: dict[str, Any] = {}
        self.config_path: str | None = None
        self.config: Config | None = None
        self.cache: ServerPromptCache | None = None
        # Ended requests by finish reason: counted by HTTP threads, read by stats requests.
        self.requests: Counter[str] = Counter()
        self._requests_lock = threading.Lock()
        self.engine: weakref.ref = lambda: None  # the batch generator built last
        # Where decode steps' time goes, over every engine this server builds (step_clock.py).
        self.step_clock = StepClock()

    def configure(self, overrides: dict[str, Any], path: str | None = None) -> None:
        """Command-line values for the next server start (``mlx-radix serve``)."""
        self.cli_overrides = dict(overrides)
        self.config_path = path

    @hookimpl
    def mlx_lm_server_start(self, cli_args):
        try:
            self.config = load_config(cli=self.cli_overrides, path=self.config_path)
        except ConfigError as e:
            exit_with_usage_error(str(e))
        agents.configure(self.config)
        set_log_level(self.config["log_level"])
        blas_notice()
        if not is_loopback(cli_args.host):
            log.warning(
                "serving on %s: reachable from other machines, and mlx_lm.server has no "
                "authentication (the default --host 127.0.0.1 is not reachable)",
                cli_args.host,
            )

    @hookimpl
    def mlx_lm_prompt_cache(self, cli_args):
        if not self.config["radix.enabled"]:
            return None
        self.cache = ServerPromptCache(self.config, max_size=cli_args.prompt_cache_size)
        return self.cache

    @hookimpl
    def mlx_lm_model_loaded(
        self, model, tokenizer, model_key, draft_model, cli_args, model_provider
    ):
        if self.cache is not None:
            # The model as the plugin serves it, then the memory plan: fusing and the warm-up
            # leave device memory MLX does not count (on an H100, 8B bf16: 3.1 GB of the
            # fused weights' former places, 1.1 GB after the warm-up, beside the CUDA
            # context's 0.5 GB), which the plan must read as used, not as the pool's room.
            prepared = self._may_serve(model, draft_model, cli_args)
            if prepared:
                self._prepare(model, cli_args)
            self.cache.bind(model, model_key, draft_model, cli_args, tokenizer)
            if prepared and self.cache.radix is None:  # it fell back to stock's cache
                compiled_pass.uninstall(model)
                compiled_layers.uninstall(model)
                fused_projections.restore(model)
        if not self.config["decode.batched"]:
            # Requests then take mlx-lm's one-at-a-time path (PoolBackedCache).
            model_provider.is_batchable = False

    def _may_serve(self, model, draft_model, cli_args) -> bool:
        """Whether the pool can serve ``model`` as far as is known before it is built (the
        server's options, the model's layers)."""
        if self.cache.fallback_reason(draft_model, cli_args) is not None:
            return False
        try:
            inspect_model(model)
        except UnsupportedModel:
            return False
        return True

    def _prepare(self, model, cli_args) -> None:
        # Fewer matmuls and graph nodes a step (engine/fused_projections.py).
        fuse = fused_projections.enabled(self.config["model.fuse_projections"])
        groups = fused_projections.prepare(model, fuse)
        if groups:
            log.info("radix: %d groups of projections fused", groups)
        # After fusing: the compiled layers hold the weights as they are now.
        mode = self.config["decode.compile"]
        if compiled_layers.enabled(mode):
            layers = compiled_layers.install(model)
            if layers:
                log.info("radix: %d layers decode through compiled calls", layers)
        if compiled_pass.enabled(mode) and compiled_pass.install(model):
            log.info("radix: paged shared decode passes run as compiled calls")
        if warmup.enabled(self.config["decode.warmup"]):
            self._warm_up(model, getattr(cli_args, "prefill_step_size", None) or 2048)

    def _warm_up(self, model, prefill_step: int) -> None:
        page_size = self.config["radix.page_size"]
        try:
            seconds = warmup.warm_up(
                model,
                page_size,
                self.config["decode.shared_prefix"],
                self.config["prefill.shared_prefix"],
                prefill_step,
                context_length(model),
            )
        except Exception:  # noqa: BLE001 - requests then build what they need, as stock's do
            log.exception("radix warm-up failed; the first requests build their kernels")
            return
        log.info("radix warm-up: the engine's paths ran in %.1f s", seconds)

    @hookimpl
    def mlx_lm_batch_generator(self, model, kwargs):
        cap = self.config["decode.max_batch_size"]
        # BatchGenerator decodes max(completion, prefill) requests at once: cap both.
        sizes = ("completion_batch_size", "prefill_batch_size")
        capped = {**kwargs, **{k: min(kwargs.get(k, cap), cap) for k in sizes}}
        radix = self.cache.radix if self.cache is not None else None
        if radix is not None:
            engine = RadixBatchGenerator(
                model,
                radix,
                shared_prefix=self.config["decode.shared_prefix"],
                decode_attention=self.config["decode.attention"],
                prefill_from_pool=self.config["prefill.from_pool"],
                prefill_shared=self.config["prefill.shared_prefix"],
                prefill_attention=self.config["prefill.attention"],
                snapshot_every=self.config["radix.snapshot_every"],
                queue_timeout=self.config["server.queue_timeout"],
                clock=self.step_clock,
                **capped,
            )
            self.engine = weakref.ref(engine)
            return engine
        if capped == kwargs:
            return None
        from mlx_lm.generate import BatchGenerator

        return BatchGenerator(model, **capped)

    @hookimpl
    def mlx_lm_http_front(self, cli_args):
        # auto keeps one process: the front measured no gain beyond the rounds' spread on two
        # H200s (8B shape, 32 streams: 1,257 and 1,588 tokens/s with it, 1,649 and 1,388
        # without; docs/benchmarking.md, "The HTTP front"), and level on MLX's CPU backend
        # (tiny shape, 32 streams: 5,389 against 5,282 tokens/s).
        return self.config["server.front"] == "on"

    @hookimpl
    def mlx_lm_generation_idle(self):
        if self.cache is not None:
            self.cache.idle()

    @hookimpl
    def mlx_lm_server_stopped(self):
        if self.cache is not None:
            self.cache.shutdown(self.config["radix.disk.shutdown_seconds"])

    @hookimpl
    def mlx_lm_request_finished(self, record):
        with self._requests_lock:
            self.requests[record.finish_reason or "unknown"] += 1

    @hookimpl
    def mlx_lm_register_routes(self, register):
        register("GET", "/v1/cache/stats", self.stats_route)
        register("GET", "/metrics", self.metrics_route)
        register("POST", "/v1/cache/pin", self.pin_route)
        register("DELETE", "/v1/cache/pin", self.pin_route)
        agents.register_routes(register)  # the agent APIs, over this pool

    def stats(self) -> dict:
        if self.cache is not None:
            stats = self.cache.stats()
        else:
            stats = idle_stats(self.config["radix.page_size"], "radix.enabled is false")
            stats["model"] = None
            stats["model_loads"] = 0  # not counted: stock's own cache serves
            stats.update(mlx_memory_stats(None))
        engine = self.engine()
        radix = self.cache.radix if self.cache is not None else None
        if engine is not None and radix is not None and engine.radix is radix:
            stats.update(engine.decode_stats)
        else:  # nothing decodes from this pool yet
            stats.update(idle_decode_stats(self.config["decode.shared_prefix"]))
        stats.update(self.step_clock.stats())
        with self._requests_lock:
            stats["requests"] = dict(self.requests)
        return stats

    def stats_route(self, request: RouteRequest) -> RouteResponse:
        return RouteResponse(200, self.stats())

    def pin_route(self, request: RouteRequest) -> RouteResponse:
        """``POST`` pins a prompt (``{"prompt": text}`` or ``{"messages": [...]}``),
        ``DELETE`` unpins it; from this machine only (they change what everyone's requests
        may evict, and mlx_lm.server has no authentication)."""
        if not is_loopback_address(request.client):
            return RouteResponse(403, {"error": "pins are changed from this machine only"})
        if ranks.size() > 1:
            # A pin changes what every rank may evict, and only rank 0 hears the request.
            error = (
                f"pins cannot change at run time under mlx.launch ({ranks.size()} ranks): "
                "HTTP reaches rank 0 only; list the prompt files in radix.pin, which every "
                "rank pins at model load"
            )
            return RouteResponse(501, {"error": error})
        cache = self.cache
        if cache is None or cache.tokenizer is None:
            return RouteResponse(409, {"error": "no model with a radix pool is loaded yet"})
        try:
            body = json.loads(request.body or b"null")
            tokens = prompt_tokens(cache.tokenizer, body, "the request body")
        except ValueError as e:  # PinError and JSON errors alike
            return RouteResponse(400, {"error": str(e)})
        if request.method == "DELETE":
            return RouteResponse(200, {"unpinned": cache.unpin(tokens)})
        box = cache.pins.run_on_generation_thread(lambda: cache.pin(tokens), ROUTE_WAIT_SECONDS)
        if "error" in box:
            return RouteResponse(409, {"error": str(box["error"])})
        if "result" not in box:
            return RouteResponse(202, {"queued": True, "prompt_tokens": len(tokens)})
        return RouteResponse(200, {"pinned_tokens": box["result"], "prompt_tokens": len(tokens)})

    def metrics_route(self, request: RouteRequest) -> RouteResponse:
        if not self.config["metrics.enabled"]:
            return RouteResponse(404, {"error": "metrics are off (metrics.enabled = false)"})
        stats = self.stats()
        text = metrics.render(stats, stats["requests"])
        return RouteResponse(200, text, "text/plain; version=0.0.4; charset=utf-8")


plugin = RadixPlugin()
