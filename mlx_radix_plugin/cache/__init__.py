"""Caches that speak mlx-lm's cache protocol over the pool, and the server's prompt cache."""
