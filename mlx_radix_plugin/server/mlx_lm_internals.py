"""The private parts of mlx-lm the plugin builds on, named in one place, checked when it loads.

The engine (``engine/generator.py``) and the batch caches (``cache/``) subclass and call
parts of mlx-lm 0.32.2 that are not its public API. ``check`` runs when the plugin's module
is imported, that is when ``mlx_lm.server --plugin radix`` loads it and before the hooks
change anything in ``mlx_lm.server``: another mlx-lm stops the start with one line, not a
request with a traceback.
"""

from __future__ import annotations

import importlib
import inspect

MLX_LM_VERSION = "0.32.2"

# (module, class, name): methods overridden or called, checked on the class.
METHODS = (
    ("mlx_lm.generate", "BatchGenerator", "_make_batch"),  # admission by pool room
    ("mlx_lm.generate", "BatchGenerator", "_next"),  # per-step work around mlx-lm's step
    ("mlx_lm.generate", "BatchGenerator", "_find_uids"),  # which pages a removal gives back
    ("mlx_lm.models.cache", "RotatingKVCache", "_temporal_order"),  # a window's tokens in order
    ("mlx_lm.generate", "GenerationBatch", "_step"),  # a decode step in bulk (decode_step.py)
    ("mlx_lm.generate", "GenerationBatch", "next"),  # less the first tokens handed over early
)
# Instance attributes, set in the constructor: checked in its source (no instance exists yet).
ATTRIBUTES = (
    ("mlx_lm.generate", "BatchGenerator", "_unprocessed_sequences"),  # the waiting queue
    ("mlx_lm.models.cache", "BatchKVCache", "_idx"),  # where the batch buffer's tokens end
    ("mlx_lm.generate", "BatchGenerator", "_currently_processing"),  # prefilling rows
    ("mlx_lm.generate", "BatchGenerator", "_uid_count"),  # the uids rows will get (row_faults)
    ("mlx_lm.generate", "GenerationBatch", "_next_logprobs"),  # the step's rows, read next
    ("mlx_lm.generate", "GenerationBatch", "_token_context"),  # logits processors' contexts
    # A row's count and stop matcher, set back where a first token went out early.
    ("mlx_lm.generate", "GenerationBatch", "_num_tokens"),
    ("mlx_lm.generate", "GenerationBatch", "_matchers"),
    ("mlx_lm.generate", "GenerationBatch", "_next_tokens"),  # the step's tokens, read next
)


class IncompatibleMlxLm(ImportError):
    """This mlx-lm is not the one the plugin was built on."""


def missing() -> list[str]:
    """The names of ``METHODS`` and ``ATTRIBUTES`` this mlx-lm lacks."""
    gone = []
    for module, cls, name in METHODS + ATTRIBUTES:
        owner = getattr(importlib.import_module(module), cls, None)
        if owner is None:
            gone.append(f"{module}.{cls}")
        elif (module, cls, name) in METHODS and not hasattr(owner, name):
            gone.append(f"{cls}.{name}")
        elif (module, cls, name) in ATTRIBUTES and f"self.{name}" not in _init_source(owner):
            gone.append(f"{cls}.{name}")
    return gone


def _init_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return ""


def check() -> None:
    """Raise ``IncompatibleMlxLm``, in one line, unless this is the mlx-lm the plugin needs."""
    import mlx_lm

    found = mlx_lm.__version__
    gone = missing()
    if found != MLX_LM_VERSION or gone:
        lacks = f", which lacks {', '.join(gone)}" if gone else ""
        raise IncompatibleMlxLm(
            f"mlx-radix needs mlx-lm=={MLX_LM_VERSION} (it uses that version's internals); "
            f'found mlx-lm {found}{lacks}. Install it: pip install "mlx-lm=={MLX_LM_VERSION}"'
        )
