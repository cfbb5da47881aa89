"""The plugin manager: entry points in the group ``mlx_lm.plugins``, activated by name."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import pluggy

from . import hookspecs

ENTRY_POINT_GROUP = "mlx_lm.plugins"

_pm: pluggy.PluginManager | None = None


class ActivationError(Exception):
    """Plugins cannot be activated: the message is the one line a user sees."""


class PluginLoadError(ActivationError):
    def __init__(self, name: str, error: Exception):
        self.name = name
        super().__init__(f"plugin {name!r} could not be loaded: {error}")


class UnknownPlugin(ActivationError, LookupError):
    def __init__(self, name: str, installed: list[str]):
        self.name = name
        self.installed = installed
        listed = ", ".join(installed) if installed else "none"
        super().__init__(f"unknown plugin {name!r}; installed plugins: {listed}")


def make_plugin_manager() -> pluggy.PluginManager:
    """A new manager with the specs and no plugins (tests use their own)."""
    pm = pluggy.PluginManager("mlx_lm")
    pm.add_hookspecs(hookspecs)
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    """The process's manager."""
    global _pm
    if _pm is None:
        _pm = make_plugin_manager()
    return _pm


def installed_plugins() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def activate(names: list[str], pm: pluggy.PluginManager | None = None) -> list[str]:
    """Load and register the named plugins; a name already active is left as it is."""
    pm = pm or get_plugin_manager()
    installed = installed_plugins()
    unknown = [n for n in names if n not in installed and not pm.has_plugin(n)]
    if unknown:
        raise UnknownPlugin(unknown[0], sorted(installed))
    for name in names:
        if not pm.has_plugin(name):
            try:
                plugin = installed[name].load()
            except Exception as e:  # its import refused this mlx-lm, or is broken
                raise PluginLoadError(name, e) from e
            pm.register(plugin, name=name)
    return names


def load_plugins(pm: pluggy.PluginManager | None = None) -> pluggy.PluginManager:
    """Activate every installed plugin (for command-line extensions); idempotent."""
    pm = pm or get_plugin_manager()
    activate(sorted(installed_plugins()), pm)
    return pm


def describe(pm: pluggy.PluginManager | None = None) -> list[dict]:
    """Each installed plugin: name, whether active, its hooks and its distribution."""
    pm = pm or get_plugin_manager()
    out = []
    for name, ep in sorted(installed_plugins().items()):
        plugin = pm.get_plugin(name)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin)) if plugin is not None else []
        dist = ep.dist
        out.append(
            {
                "name": name,
                "active": plugin is not None,
                "hooks": hooks,
                "entry_point": ep.value,
                "package": dist.name if dist else None,
                "version": dist.version if dist else None,
            }
        )
    return out
