"""The prompt cache mlx_lm.server gets when the radix plugin is active.

The server builds its prompt cache before it loads a model, and may load another
model later; the pool depends on the model. So this object is what the server
holds: on every model load it builds a pool and a ``RadixPromptCache`` for that
model, or, when the model cannot use the pool, serves from stock mlx-lm's
``LRUPromptCache`` and says why in ``fallback``.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import LRUPromptCache

from ..cache.prompt_cache import RadixPromptCache, idle_stats
from ..cache.tiering import (
    Tiering,
    disk_dtype_supported,
    disk_identity,
    prefill_seconds_per_token,
)
from ..config import Config, cache_dir
from ..memory import ranks
from ..memory.budget import buffer_cache_limit, device_memory
from ..memory.disk_tier import DiskTier, DiskTierOff
from ..memory.freed_buffers import FreedBuffers
from ..memory.pool import KVPool, UnsupportedModel, model_nbytes
from ..memory.working_set import WorkingSet
from .pins import PinError, Pins, prefill, read_pin_file

log = logging.getLogger("mlx_radix")

# Most of the pool's pages that pins may hold: the rest stays for requests.
PIN_SHARE = 0.5

# What each rank of mlx.launch reports through rank 0's stats (``ranks``): the pool's size,
# what its tree holds, what requests hold, and what it evicted and hit. All in pages,
# tokens and counts, which agree across ranks when the ranks decide alike.
RANK_STATS = (
    "pages_max",
    "pages_total",
    "pages_cached",
    "page_refs",
    "pages_locked",
    "tree_locks",
    "requests_holding_pages",
    "pins",
    "pinned_pages",
    "evictions",
    "hits",
    "misses",
    "cached_tokens",
    "snapshots",
    "snapshot_evictions",
)

# Settings that may differ between the hosts of mlx.launch: memory (each rank plans for its
# own device, then the pools are agreed: KVPool.agreed), the disk tier (off there), logging.
PER_HOST = (
    "log_level",
    "metrics.",
    "radix.disk.",
    "radix.pool_tokens",
    "radix.mem_fraction",
    "radix.chunk_mib",
    "radix.snapshot_mib",
    "radix.buffer_cache_fraction",
    "radix.hold_to_plan",
)

NOT_LOADED = "no model loaded yet"


class ServerPromptCache:
    def __init__(self, config: Config, max_size: int = 10, max_bytes: int = 1 << 63):
        self.config = config
        self._stock_args = (max_size, max_bytes)
        self.radix: RadixPromptCache | None = None
        self.stock: LRUPromptCache | None = None
        self.model_key: Hashable | None = None
        self.fallback: str | None = NOT_LOADED
        self.buffer_cache_limit: int | None = None  # set on MLX at bind; None: MLX's own
        self.working_set: WorkingSet | None = None  # the radix path's, at bind
        # Models loaded: each load starts an empty pool, and a client can ask for one by
        # naming another model (stock loads what is asked for), emptying everyone's cache.
        self.model_loads = 0
        self.model = self.tokenizer = None
        self.prefill_step = 2048
        self.pins = Pins()  # pin requests for the generation thread
        self.rank_stats: list[dict] | None = None  # under mlx.launch, as of the last idle

    def fallback_reason(self, draft_model, cli_args) -> str | None:
        """Why the server's options rule out the pool for any model, or None."""
        if getattr(cli_args, "kv_bits", None) is not None:
            return "--kv-bits quantizes the KV cache, which the pool stores unquantized"
        if draft_model is not None:
            return "a draft model (speculative decoding) keeps a second cache"
        return None

    def bind(
        self, model, model_key: Hashable, draft_model=None, cli_args=None, tokenizer=None
    ) -> None:
        """Serve ``model`` from now on: a fresh pool for it, or the stock cache."""
        self.model_loads += 1
        self.shutdown(self.config["radix.disk.shutdown_seconds"])  # the last model's tier
        self.radix = self.stock = None
        gc.collect()
        mx.clear_cache()  # the old pool's memory goes back before the new one is taken
        # Stats name the model once its cache is ready: a reader that sees the model sees
        # its pool, or the fallback and its reason.
        self.model_key = None
        reason = self.fallback_reason(draft_model, cli_args)
        cfg, pool = self.config, None
        ranks.own_garbage_collection()
        # Each rank reads its own host's settings; those that decide in tokens and pages must
        # be the same everywhere.
        decisive = sorted((k, v) for k, v in cfg.values.items() if not k.startswith(PER_HOST))
        if not ranks.same(repr(decisive).encode()) and reason is None:
            reason = (
                "the radix settings differ between the ranks of mlx.launch (compare "
                "`mlx-radix config show` on each host; only memory, disk and logging settings "
                "may differ)"
            )
        if reason is None:
            try:
                pool = KVPool.for_model(
                    model,
                    page_size=cfg["radix.page_size"],
                    pool_tokens=cfg["radix.pool_tokens"] or None,
                    mem_fraction=cfg["radix.mem_fraction"],
                    max_batch_size=cfg["decode.max_batch_size"],
                    chunk_bytes=cfg["radix.chunk_mib"] << 20 or None,
                    prefill_step_size=getattr(cli_args, "prefill_step_size", None) or 2048,
                    snapshot_bytes=cfg["radix.snapshot_mib"] << 20 or None,
                )
            except UnsupportedModel as e:
                reason = str(e)
            except Exception as e:  # noqa: BLE001 - the server goes on, uncached, and says why
                log.exception("radix KV pool for %s could not be built", model_key)
                reason = f"the KV pool could not be built: {type(e).__name__}: {e}"
        # Under mlx.launch every rank serves from a pool or none does (one that prefills what
        # the others hit would run other collectives), and the pools are alike (``agreed``).
        if not ranks.all_agree(reason is None) and reason is None:
            reason = "another rank of mlx.launch could not build its KV pool (see its log)"
        # A pipeline rank may hold only attention layers of a hybrid model, and would fetch
        # by the plain path while the others resume recurrent state.
        if reason is None and not ranks.same(bytes([bool(pool.recurrent)])):
            reason = "a hybrid model's recurrent layers are on some ranks of mlx.launch only"
        if reason is None:
            pool = pool.agreed()
            self.radix = RadixPromptCache(pool, eviction=cfg["radix.eviction"])
            self.radix.defer_finished = True
            if cfg["radix.disk.enabled"]:
                self.radix.tiering = self._disk_tier(pool, model, model_key, cli_args)
            plan = pool.plan
            if plan.warning:
                log.warning("radix KV pool: %s", plan.warning)
            log.info(
                "radix KV pool: up to %d pages x %d tokens (%.1f MiB, %s), allocated in "
                "chunks of %d pages as needed; %.2f GiB usable (%s), model %.2f GiB, "
                "working memory %.2f GiB, margin %.2f GiB",
                pool.max_pages,
                pool.page_size,
                pool.max_nbytes / 2**20,
                pool.dtype,
                pool.allocator.chunk_pages,
                plan.usable_bytes / 2**30,
                plan.source,
                plan.model_bytes / 2**30,
                plan.working_bytes / 2**30,
                plan.margin_bytes / 2**30,
            )
            if pool.recurrent:
                log.info(
                    "radix KV pool: hybrid model, %d of its %d layer caches recurrent; their state "
                    "is kept in snapshots, up to %.1f MiB",
                    len(pool.recurrent),
                    len(pool.layout),
                    pool.snapshot_budget / 2**20,
                )
        self.fallback = reason
        if reason is not None:
            log.warning("radix cache off for %s, stock prompt cache instead: %s", model_key, reason)
            self.stock = LRUPromptCache(*self._stock_args)
        self._limit_mlx_memory(model)
        self.model, self.tokenizer = model, tokenizer
        self.prefill_step = getattr(cli_args, "prefill_step_size", None) or 2048
        for path in self.config["radix.pin"] if self.radix is not None else ():
            try:
                tokens, error = read_pin_file(tokenizer, path), None
            except PinError as e:
                tokens, error = [], e
            # Each rank reads its own host's file, and a prefill is a collective: every rank
            # pins the same tokens, or none does.
            same = ranks.same(np.asarray(tokens, dtype=np.int64).tobytes())
            if error is None and not same:
                error = PinError(f"{path} is not the same on every rank of mlx.launch")
            try:
                if error is not None:
                    raise error
                pinned = self.pin(tokens, model_key)
            except PinError as e:
                log.warning("radix.pin: %s; not pinned", e)
            else:
                log.info("radix.pin: %s pinned, %d tokens", path, pinned)
        self.model_key = model_key

    def pin(self, tokens: Sequence[int], model_key: Hashable | None = None) -> int:
        """Prefill ``tokens`` (what the pool lacks) and pin their whole pages, under
        ``model_key`` (default: the model served); returns the tokens pinned. Raises
        ``PinError`` when the pins would take more than ``PIN_SHARE`` of the pool. Runs on
        the generation thread."""
        model_key = self.model_key if model_key is None else model_key
        radix = self.radix
        if radix is None:
            raise PinError(f"no radix pool to pin in: {self.fallback}")
        pool = radix.pool
        pages = radix.pinned_pages((model_key, tokens))
        most = int(pool.max_pages * PIN_SHARE)
        if pages > most:
            raise PinError(
                f"pinning these {len(tokens)} tokens would pin {pages} pages of "
                f"{pool.page_size} tokens; pins may hold at most {most} of the pool's "
                f"{pool.max_pages} pages (half): unpin others or give the pool more room "
                "(radix.pool_tokens, radix.mem_fraction)"
            )
        prefill(radix, self.model, model_key, tokens, self.prefill_step)
        pinned = radix.pin(model_key, tokens)
        if not pinned and len(tokens) >= pool.page_size:
            raise PinError("the prompt's pages could not be kept in the pool (no room)")
        return pinned

    def unpin(self, tokens: Sequence[int]) -> bool:
        radix = self.radix
        return radix is not None and radix.unpin(self.model_key, tokens)

    def _disk_tier(self, pool: KVPool, model, model_key: Hashable, cli_args) -> Tiering | None:
        """The disk tier under ``pool``, or None (and why, logged) when it cannot be used."""
        cfg = self.config
        if ranks.size() > 1:
            log.warning(
                "disk tier off: under mlx.launch (%d ranks) each rank would need files of its "
                "own shard and a hit length agreed by all; not built yet",
                ranks.size(),
            )
            return None
        if not disk_dtype_supported(pool.dtype):
            log.warning("disk tier off: K/V of dtype %s is not stored on disk", pool.dtype)
            return None
        root = Path(cfg["radix.disk.dir"] or cache_dir() / "disk").expanduser()
        about = {
            "model": public_name(model_key[0] if isinstance(model_key, tuple) else model_key),
            "adapter": public_name(model_key[1]) if isinstance(model_key, tuple) else None,
        }
        budget = cfg["radix.disk.mib"] << 20
        try:
            # With the default budget, no eviction until the tier has read what it holds,
            # which counts towards it.
            disk = DiskTier(root, disk_identity(model, pool), budget or 1 << 62, about=about)
        except DiskTierOff as e:
            log.warning("disk tier off: %s; the server goes on without it", e)
            return None
        if not budget:
            budget = default_disk_bytes(root, disk.nbytes)
            if budget <= 0:
                disk.close()
                log.warning("disk tier off: no free space under %s", root)
                return None
            disk.set_budget(budget)
        restore = cfg["radix.disk.restore"]
        rate = prefill_seconds_per_token(model) if restore == "auto" else None
        write = cfg["radix.disk.write"]
        if write == "auto":  # see cache/tiering.py for what each cost where
            write = "through" if mx.default_device() == mx.cpu else "idle"
        tiering = Tiering(pool, disk, model_key, restore=restore, prefill_rate=rate, write=write)
        tiering.measure_reads()
        log.info(
            "disk tier: %s, %d pages (%.1f MiB) found, budget %.1f GiB, written %s; a page "
            "read back in %s, computed in %s",
            disk.dir,
            len(disk),
            disk.nbytes / 2**20,
            budget / 2**30,
            "as committed" if write == "through" else "when idle",
            "(not measured)" if tiering.read_rate is None else f"{tiering.read_rate * 1e3:.2f} ms",
            "(not measured)" if rate is None else f"{rate * pool.page_size * 1e3:.2f} ms",
        )
        if not tiering.worth_reading():
            log.warning(
                "disk tier: computing a page is faster than reading it back here: pages are "
                "kept on disk but not read (radix.disk.restore = on reads them)"
            )
        limit = min(cfg["radix.disk.preload_tokens"], pool.max_pages * pool.page_size // 2)
        if limit:
            with self.radix.pool.lock:
                loaded = tiering.preload(self.radix.tree, model_key, limit)
            log.info("disk tier: %d tokens read into the pool at load", loaded)
        return tiering

    def shutdown(self, seconds: float) -> None:
        """Write what the pool holds and the disk tier lacks, for at most ``seconds``; call
        it where no generation runs (the server stopped, or a model load)."""
        radix = self.radix
        tiering = radix.tiering if radix is not None else None
        if tiering is None:
            return
        deadline = time.monotonic() + seconds
        radix.commit_finished()
        with radix.pool.lock:
            radix.pool.run_deferred()
            written = tiering.save_tree(radix.tree, deadline, radix.snapshots)
        done = tiering.disk.close(max(0.0, deadline - time.monotonic()))
        radix.tiering = None
        log.info(
            "disk tier: %d pages written at shutdown%s",
            written,
            "" if done else f" (stopped after {seconds:g} s with writes left)",
        )

    def _limit_mlx_memory(self, model) -> None:
        """Bound MLX's cache of freed buffers by what the model, the pool and the batch
        buffers leave, and measure (and, with ``radix.hold_to_plan``, hold) each engine
        call's working memory to the plan's."""
        if self.working_set is not None:
            self.working_set.release()  # the last model's
            self.working_set = None
        if self.radix is not None:
            pool = self.radix.pool
            self.working_set = pool.working_set = WorkingSet(
                pool, model_nbytes(model), self.radix.snapshots, self.config["radix.hold_to_plan"]
            )
        fraction = self.config["radix.buffer_cache_fraction"]
        if not fraction:
            return
        pool_bytes = reserve = 0
        working = None
        if self.radix is not None:
            pool = self.radix.pool  # built by KVPool.for_model: it has a plan
            pool_bytes, reserve = pool.max_nbytes, pool.plan.buffer_reserve_bytes or 0
            working = pool.plan.working_bytes
        limit = buffer_cache_limit(
            fraction, device_memory(), model_nbytes(model), pool_bytes, reserve, working
        )
        mx.set_cache_limit(limit)
        self.buffer_cache_limit = limit
        if self.radix is not None:
            self.radix.pool.freed_buffers = FreedBuffers(limit)
        log.info("MLX buffer cache limit: %.1f MiB", limit / 2**20)
        if mx.metal.is_available():
            # What stays wired (never paged out) on a Mac: the model, the pool's ceiling and
            # the buffer cache, within the recommended working set.
            most = int(mx.device_info()["max_recommended_working_set_size"])
            mx.set_wired_limit(min(most, model_nbytes(model) + pool_bytes + limit))

    def idle(self) -> None:
        """Nothing is being generated: commit the requests that finished last, give back
        the pool's chunks that stayed empty, write to the disk tier, run pin requests (and,
        under mlx.launch, gather every rank's ``RANK_STATS``)."""
        ranks.idle()  # under mlx.launch, the garbage of the steps that ran, on every rank
        radix = self.radix
        # Commits left by the last step mean the batch has just drained, and a chat's next
        # turn may be on its way: the rest waits for the next call (0.1 s on, if no request
        # came), as it did before the hook ran ahead of the wait.
        if not (radix is not None and radix.commit_finished()):
            self._settle(radix)
        if ranks.size() > 1:
            # Every rank is idle at once (mlx_lm.server shares rank 0's empty queue), and has
            # a pool or not alike (bind).
            stats = radix.stats(RANK_STATS) if radix is not None else {}
            gathered = ranks.gather([stats.get(k) or 0 for k in RANK_STATS])
            self.rank_stats = [dict(zip(RANK_STATS, values)) for values in gathered]

    def _settle(self, radix: RadixPromptCache | None) -> None:
        """The idle work that can wait: empty chunks back, the disk tier's writes, pins."""
        if radix is not None:
            radix.pool.trim()
            if radix.tiering is not None:
                radix.tiering.pump(everything=True)
                with radix.pool.lock:
                    radix.tiering.write_later(radix.tree)
                    if radix.tiering.save_states(radix.tree, radix.snapshots):
                        radix.tiering.pump(everything=True)
        self.pins.run_jobs()

    @property
    def active(self) -> Any:
        if self.radix is not None:
            return self.radix
        if self.stock is None:
            self.stock = LRUPromptCache(*self._stock_args)
        return self.stock

    # -- LRUPromptCache interface, routed to the active cache ----------------------

    def __len__(self) -> int:
        return len(self.active)

    @property
    def nbytes(self) -> int:
        return self.active.nbytes

    def stats_by_type(self) -> dict:
        return self.active.stats_by_type()

    def fetch_nearest_cache(self, model_key: Hashable, tokens: Sequence[int]):
        return self.active.fetch_nearest_cache(model_key, tokens)

    def insert_cache(self, model_key: Hashable, tokens, prompt_cache, *, cache_type="assistant"):
        return self.active.insert_cache(model_key, tokens, prompt_cache, cache_type=cache_type)

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        return self.active.trim_to(n_sequences=n_sequences, n_bytes=n_bytes)

    # -- what /v1/cache/stats shows -------------------------------------------------

    def stats(self) -> dict:
        radix = self.radix  # read once: a model load on the generation thread may swap it
        if radix is not None:
            stats = radix.stats()
        else:
            stats = idle_stats(self.config["radix.page_size"], self.fallback)
            stats["cached_sequences"] = len(self.stock) if self.stock is not None else 0
        stats["fallback"] = self.fallback
        stats["model"] = public_model_key(self.model_key)
        stats["model_loads"] = self.model_loads
        plan = radix.pool.plan if radix is not None else None
        stats["memory_plan"] = plan.as_dict() if plan is not None else None
        freed = radix.pool.freed_buffers if radix is not None else None
        stats.update(
            mlx_memory_stats(self.buffer_cache_limit, freed.trims if freed else 0, self.working_set)
        )
        if self.rank_stats is not None:
            stats["ranks"] = self.rank_stats
        return stats


def public_name(part: Any) -> Any:
    """A local path by its last part only (see ``public_model_key``)."""
    return Path(part).name if isinstance(part, str) and os.path.isabs(part) else part


def default_disk_bytes(root: Path, held: int) -> int:
    """A quarter of the space of the file system ``root`` is on that is free or held by
    the tier already (``held`` bytes: else a full tier would shrink its own budget at each
    start), at most 64 GiB."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = 0
    return min((free + held) // 4, 64 << 30)


def public_model_key(model_key: Hashable | None) -> list | None:
    """The model key as stats show it: a local path by its last part only, since the stats
    are readable cross-origin under stock's default ``--allowed-origins *``."""
    if model_key is None:
        return None
    return [public_name(part) for part in model_key]


def mlx_memory_stats(
    cache_limit: int | None, trims: int = 0, working: WorkingSet | None = None
) -> dict:
    """What MLX holds: live arrays (the model, the pool, working memory) and its cache of
    freed buffers, which takes device memory as much as live ones; ``cache_limit`` is the
    limit the server set (None: MLX's own), ``trims`` the engine's calls that found that
    cache full and released its oldest buffers (memory/freed_buffers.py); ``working`` the
    radix path's measure of working memory against the plan's (memory/working_set.py)."""
    stats = {
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_cache_bytes": mx.get_cache_memory(),
        "mlx_peak_bytes": mx.get_peak_memory(),
        "mlx_cache_limit_bytes": cache_limit,
        "mlx_cache_trims": trims,
        "mlx_memory_limit_bytes": None,
        "working_bytes": None,
        "working_peak_prefill_bytes": 0,
        "working_peak_decode_bytes": 0,
        "working_peak_prefill_pass": None,
    }
    if working is not None:
        stats.update(working.stats(), mlx_peak_bytes=working.mlx_peak_bytes)
    return stats
