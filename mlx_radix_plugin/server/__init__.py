"""The ``radix`` plugin for mlx_lm.server: its hooks, its prompt cache per model, metrics."""
