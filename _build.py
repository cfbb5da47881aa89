"""Build step: put the plugin host's start-up files at the root of site-packages.

``mlx_lm_hooks.pth`` (import line, every Python) and ``mlx_lm_hooks.start`` (PEP 829
entry point, Python 3.15+, which then ignores the .pth's import line) make
``mlx_lm.server --plugin NAME`` work on an unmodified mlx-lm. Editable installs do
not carry files outside packages, so install with ``pip install .``.
"""

import os

from setuptools.command.build_py import build_py

STARTUP_FILES = ("mlx_lm_hooks.pth", "mlx_lm_hooks.start")
SOURCE_DIR = os.path.join("hooks", "mlx_lm_hooks")


class BuildPy(build_py):
    def run(self):
        super().run()
        for name in STARTUP_FILES:
            self.copy_file(os.path.join(SOURCE_DIR, name), os.path.join(self.build_lib, name))

    def get_outputs(self, include_bytecode=1):
        extra = [os.path.join(self.build_lib, name) for name in STARTUP_FILES]
        return super().get_outputs(include_bytecode) + extra
