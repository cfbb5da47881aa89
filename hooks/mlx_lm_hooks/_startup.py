"""Runs at interpreter start, from ``mlx_lm_hooks.pth`` (or ``mlx_lm_hooks.start``).

It must cost nothing and never raise. Unless a plugin was asked for (``--plugin``
on the command line or ``MLX_LM_PLUGINS`` in the environment) it does nothing.
Otherwise it loads a fast CPU BLAS for MLX where that applies (:mod:`.blas`: it must
come before ``mlx.core`` is imported), then waits for ``mlx_lm.server`` to be imported and
wraps its ``main`` so that ``mlx_lm.server --plugin NAME``, ``mlx_lm server --plugin NAME``
and ``python -m mlx_lm server --plugin NAME`` start the server with those plugins.
"""

import os
import sys

ENV = "MLX_LM_PLUGINS"
FLAG = "--plugin"


class PluginArgumentError(ValueError):
    pass


def split_plugin_args(argv: list, environ=os.environ) -> tuple:
    """(plugin names, argv without --plugin options); MLX_LM_PLUGINS names come first."""
    names = [n for n in environ.get(ENV, "").replace(",", " ").split() if n]
    rest = []
    it = iter(argv)
    for arg in it:
        if arg == FLAG:
            value = next(it, None)
            if value is None or value.startswith("-"):
                raise PluginArgumentError(f"{FLAG} needs a plugin name")
        elif arg.startswith(FLAG + "="):
            value = arg[len(FLAG) + 1 :]
            if not value:
                raise PluginArgumentError(f"{FLAG} needs a plugin name")
        else:
            rest.append(arg)
            continue
        names.extend(n for n in value.split(",") if n)
    return list(dict.fromkeys(names)), rest


def _asked(argv, environ) -> bool:
    return bool(environ.get(ENV)) or any(a == FLAG or a.startswith(FLAG + "=") for a in argv)


def _main_with_plugins(stock_main):
    def main():
        from .plugins import ActivationError
        from .server import serve

        try:
            names, rest = split_plugin_args(sys.argv[1:])
        except PluginArgumentError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        try:
            return serve(names, rest)
        except ActivationError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    main.__wrapped__ = stock_main
    main.__doc__ = stock_main.__doc__
    return main


class _ServerLoader:
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.main = _main_with_plugins(module.main)

    def __getattr__(self, name):
        # get_source, is_package, ...: tracebacks and tools ask the real loader.
        return getattr(self._loader, name)


class _ServerFinder:
    """Wraps ``mlx_lm.server.main`` when that module is first imported."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "mlx_lm.server":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ServerLoader(spec.loader)
                return spec
        return None


def bootstrap() -> None:
    try:
        if not _asked(sys.argv, os.environ):
            return
        from . import blas

        blas.preload()
        if any(isinstance(f, _ServerFinder) for f in sys.meta_path):
            return  # the .pth was seen twice
        if "mlx_lm.server" in sys.modules:
            server = sys.modules["mlx_lm.server"]
            if not hasattr(server.main, "__wrapped__"):
                server.main = _main_with_plugins(server.main)
            return
        sys.meta_path.insert(0, _ServerFinder())
    except Exception as e:  # noqa: BLE001
        # A broken plugin host must never stop Python from starting; but plugins were asked
        # for, so say in one line why they will not be there (else all the user sees is
        # mlx_lm.server's "unrecognized arguments: --plugin").
        print(f"mlx_lm_hooks: plugins not activated: {type(e).__name__}: {e}", file=sys.stderr)
