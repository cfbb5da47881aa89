"""Prometheus text exposition of the cache statistics."""

from __future__ import annotations

from collections.abc import Mapping

# stats key -> (metric name, type, help)
METRICS = {
    "hits": ("mlx_radix_prompt_cache_hits_total", "counter", "Prompts that reused cached tokens."),
    "misses": ("mlx_radix_prompt_cache_misses_total", "counter", "Prompts with nothing cached."),
    "prompt_tokens": ("mlx_radix_prompt_tokens_total", "counter", "Prompt tokens looked up."),
    "cached_tokens": (
        "mlx_radix_cached_tokens_total",
        "counter",
        "Prompt tokens served from the cache instead of computed.",
    ),
    "evictions": ("mlx_radix_evicted_pages_total", "counter", "Pages evicted to make room."),
    "pool_bytes_used": ("mlx_radix_pool_bytes_used", "gauge", "Bytes of pool pages in use."),
    "pool_bytes_total": (
        "mlx_radix_pool_bytes_total",
        "gauge",
        "Bytes the pool holds: its chunks allocated now.",
    ),
    "pool_bytes_max": (
        "mlx_radix_pool_bytes_max",
        "gauge",
        "Bytes the pool may grow to (its ceiling).",
    ),
    "buffer_bytes": (
        "mlx_radix_buffer_bytes",
        "gauge",
        "K/V bytes held outside the pool: batch buffers and private copies.",
    ),
    "pool_chunks": ("mlx_radix_pool_chunks", "gauge", "Chunks of the pool allocated now."),
    "pages_total": ("mlx_radix_pages_total", "gauge", "Pages in the pool's allocated chunks."),
    "pages_max": ("mlx_radix_pages_max", "gauge", "Pages the pool may grow to."),
    "pages_free": ("mlx_radix_pages_free", "gauge", "Pages free."),
    "pages_locked": ("mlx_radix_pages_locked", "gauge", "Pages held by running requests."),
    "pages_evictable": (
        "mlx_radix_pages_evictable",
        "gauge",
        "Cached pages no request holds (evictable).",
    ),
    "cached_sequences": ("mlx_radix_cached_sequences", "gauge", "Distinct cached sequences."),
    "pages_cached": ("mlx_radix_pages_cached", "gauge", "Pages the radix tree holds."),
    "page_refs": ("mlx_radix_page_refs", "gauge", "References to pages, tree and requests."),
    "tree_locks": ("mlx_radix_tree_locks", "gauge", "Prefix locks held by requests."),
    "requests_holding_pages": (
        "mlx_radix_requests_holding_pages",
        "gauge",
        "Requests holding pool pages.",
    ),
    "snapshots": (
        "mlx_radix_snapshots",
        "gauge",
        "Recurrent-state snapshots held (hybrid models).",
    ),
    "prefill_passes_grouped": (
        "mlx_radix_prefill_passes_grouped_total",
        "counter",
        "Prompt passes whose rows read a prefix they share once a layer.",
    ),
    "prefill_passes_per_row": (
        "mlx_radix_prefill_passes_per_row_total",
        "counter",
        "Prompt passes over the pool whose rows each read their own context.",
    ),
    "snapshot_bytes": ("mlx_radix_snapshot_bytes", "gauge", "Bytes of the snapshots held."),
    "snapshot_bytes_max": (
        "mlx_radix_snapshot_bytes_max",
        "gauge",
        "Bytes the snapshots may take (their own budget).",
    ),
    "snapshot_hits": (
        "mlx_radix_snapshot_hits_total",
        "counter",
        "Requests that resumed from a snapshot.",
    ),
    "snapshot_evictions": (
        "mlx_radix_snapshot_evictions_total",
        "counter",
        "Snapshots dropped to make room for others.",
    ),
    "disk_enabled": ("mlx_radix_disk_enabled", "gauge", "1 while the disk tier is on."),
    "disk_hits": (
        "mlx_radix_disk_hits_total",
        "counter",
        "Prompts that read cached pages back from the disk tier.",
    ),
    "disk_pages_read": ("mlx_radix_disk_pages_read_total", "counter", "Pages read from disk."),
    "disk_pages_written": (
        "mlx_radix_disk_pages_written_total",
        "counter",
        "Pages written to disk.",
    ),
    "disk_writes_dropped": (
        "mlx_radix_disk_writes_dropped_total",
        "counter",
        "Page writes dropped because the disk's queue was full.",
    ),
    "disk_corrupt": (
        "mlx_radix_disk_corrupt_total",
        "counter",
        "Files on disk that failed their check and were moved aside.",
    ),
    "disk_pages": ("mlx_radix_disk_pages", "gauge", "Pages the disk tier holds."),
    "disk_states": (
        "mlx_radix_disk_states",
        "gauge",
        "Recurrent states (hybrid models) the disk tier holds.",
    ),
    "disk_bytes": ("mlx_radix_disk_bytes", "gauge", "Bytes of the pages on disk."),
    "disk_bytes_max": ("mlx_radix_disk_bytes_max", "gauge", "The disk tier's budget in bytes."),
    "disk_restores_skipped": (
        "mlx_radix_disk_restores_skipped_total",
        "counter",
        "Prompts that computed pages the disk held, computing being measured faster.",
    ),
    "disk_restore_seconds": (
        "mlx_radix_disk_restore_seconds_total",
        "counter",
        "Seconds spent reading pages back from disk into the pool.",
    ),
    "decode_rows": ("mlx_radix_decode_rows", "gauge", "Requests in the decode batch."),
    "decode_groups": (
        "mlx_radix_decode_groups",
        "gauge",
        "Groups of decoding requests that read their shared prefix once.",
    ),
    "decode_shared_tokens": (
        "mlx_radix_decode_shared_tokens",
        "gauge",
        "Tokens of prefixes the decode batch reads once for several requests.",
    ),
    "model_loads": (
        "mlx_radix_model_loads_total",
        "counter",
        "Models loaded; each starts an empty pool (a request naming another model loads it).",
    ),
    "mlx_active_bytes": ("mlx_radix_mlx_active_bytes", "gauge", "Bytes of MLX's live arrays."),
    "mlx_cache_bytes": (
        "mlx_radix_mlx_cache_bytes",
        "gauge",
        "Bytes MLX keeps as freed buffers for reuse.",
    ),
    "mlx_cache_trims": (
        "mlx_radix_mlx_cache_trims_total",
        "counter",
        "Engine calls that found MLX's cache of freed buffers full and released its oldest.",
    ),
    "working_peak_prefill_bytes": (
        "mlx_radix_working_peak_prefill_bytes",
        "gauge",
        "Most working memory a prompt pass held, from its start to the next pass or its "
        "engine call's end (MLX's peak of live arrays less the model, the pool and its "
        "snapshots).",
    ),
    "working_peak_decode_bytes": (
        "mlx_radix_working_peak_decode_bytes",
        "gauge",
        "Most working memory the rest of an engine call held (its decode step, rows joining it).",
    ),
    "decode_steps_shared": (
        "mlx_radix_decode_steps_shared_total",
        "counter",
        "Decode steps that read shared prefixes once (shared-prefix decode).",
    ),
    "decode_steps_exact": (
        "mlx_radix_decode_steps_exact_total",
        "counter",
        "Decode steps on the exact path (mlx-lm's batch buffer).",
    ),
    "decode_buffer_bytes": (
        "mlx_radix_decode_buffer_bytes",
        "gauge",
        "K/V bytes the decode batch holds outside the pool.",
    ),
    "prefill_buffer_bytes": (
        "mlx_radix_prefill_buffer_bytes",
        "gauge",
        "K/V bytes the batch being prefilled holds outside the pool.",
    ),
}


def render(stats: Mapping, requests: Mapping[str, int]) -> str:
    lines = []
    for key, (name, kind, help_text) in METRICS.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {stats[key]}"]
    reason = stats.get("fallback")
    lines += [
        "# HELP mlx_radix_fallback 1 when the radix path is off for the loaded model.",
        "# TYPE mlx_radix_fallback gauge",
        f'mlx_radix_fallback{{reason="{_escape(reason or "")}"}} {int(reason is not None)}',
        "# HELP mlx_radix_decode_path 1 for the path the decode batch takes (shared or exact).",
        "# TYPE mlx_radix_decode_path gauge",
        *(
            f'mlx_radix_decode_path{{path="{path}"}} {int(stats.get("decode_path") == path)}'
            for path in ("shared", "exact")
        ),
        "# HELP mlx_radix_requests_total Requests ended, by finish reason.",
        "# TYPE mlx_radix_requests_total counter",
    ]
    for why, n in sorted(requests.items()):
        lines.append(f'mlx_radix_requests_total{{finish_reason="{_escape(why)}"}} {n}')
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
