"""The package's shape: no import cycles, folders layered, pure-Python modules free of MLX."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_radix_plugin"
# Each folder may import only from folders before it in this list (and itself).
LAYERS = ["config", "memory", "cache", "engine", "agents", "server", "models", "tools", "cli"]
# Modules that must import without MLX or mlx-lm installed.
PURE = [
    "mlx_radix_plugin.config",
    "mlx_radix_plugin.memory.allocator",
    "mlx_radix_plugin.memory.radix_tree",
    "mlx_radix_plugin.server.metrics",
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> package modules it imports anywhere in its body (deferred imports too)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if v not in state and (cycle := visit(v)):
                return cycle
        state[u] = 2
        stack.pop()
        return None

    for u in sorted(graph):
        if u not in state and (cycle := visit(u)):
            return cycle
    return None


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_the_graph_finds_a_cycle_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_between_modules():
    graph = import_graph()
    assert len(graph) > 20
    assert find_cycle(graph) is None


def test_folders_import_only_from_the_layers_below():
    for module, imports in import_graph().items():
        here = layer_of(module)
        if here is None:  # the package's __init__ re-exports lazily
            continue
        for target in imports:
            there = layer_of(target)
            assert there is not None and LAYERS.index(there) <= LAYERS.index(here), (
                f"{module} ({here}) imports {target} ({there})"
            )


def test_every_folder_is_a_known_layer():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert folders | modules == set(LAYERS)


def test_pure_python_modules_import_without_mlx():
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('mlx', 'mlx_lm'):\n"
        "            raise ImportError(f'{name} is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "try:\n"
        "    import mlx.core\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('the blocker let mlx through')\n"
    )
    imports = "".join(f"import {m}\n" for m in PURE)
    check = "assert not [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]\n"
    r = subprocess.run(
        [sys.executable, "-c", blocker + imports + check + "print('ok')"],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_public_names_import_from_the_package():
    import mlx_radix_plugin

    for name in mlx_radix_plugin.__all__:
        assert getattr(mlx_radix_plugin, name).__name__ == name
