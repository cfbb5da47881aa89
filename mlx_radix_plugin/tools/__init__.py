"""Tools around the server: the benchmark against stock mlx_lm.server, the soak, the GPU bench."""
