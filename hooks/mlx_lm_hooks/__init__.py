"""Plugin host for mlx-lm.

Named ``mlx_lm_hooks`` (not ``hooks``) so it cannot collide with other projects'
top-level ``hooks`` modules.
"""
