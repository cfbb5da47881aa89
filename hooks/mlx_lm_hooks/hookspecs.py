"""Hook specifications for mlx-lm's generation lifecycle."""

import pluggy

hookspec = pluggy.HookspecMarker("mlx_lm")
hookimpl = pluggy.HookimplMarker("mlx_lm")


@hookspec
def mlx_lm_server_start(cli_args):
    """mlx_lm.server parsed its arguments (an argparse.Namespace) and is about to serve."""


@hookspec
def mlx_lm_model_loaded(model, tokenizer, model_key, draft_model, cli_args, model_provider):
    """The server loaded a model; model_key is (model_path, adapter_path, draft_model_path)."""


@hookspec(firstresult=True)
def mlx_lm_prompt_cache(cli_args):
    """Return the server's prompt cache (LRUPromptCache's interface), or None for stock."""


@hookspec(firstresult=True)
def mlx_lm_batch_generator(model, kwargs):
    """Return the server's batch generator for model (BatchGenerator's interface), or None."""
    # One that can fail a row alone also has ``failed_rows() -> {uid: why}``, read after
    # each ``next()``: those rows' requests get an error (mlx_lm_hooks.server.RowFailed).


@hookspec
def mlx_lm_generation_idle():
    """The generation thread has no request to serve (called about every 0.1 s meanwhile)."""


@hookspec
def mlx_lm_request_finished(record):
    """A request ended (finished, stopped, disconnected or failed): a RequestRecord."""


@hookspec
def mlx_lm_server_stopped():
    """The server stopped (SIGINT, SIGTERM, Ctrl-C) and its generation thread has ended."""


@hookspec(firstresult=True)
def mlx_lm_http_front(cli_args):
    """Return True to serve HTTP from a process of its own (front.py); False or None: one."""


@hookspec
def mlx_lm_register_routes(register):
    """Call register(method, path, handler) to serve extra HTTP routes (see routes.py)."""


@hookspec
def mlx_lm_register_commands(cli):
    """Add commands to a click command group."""
