"""``mlx-radix bench``: stock mlx_lm.server and the plugin's server, side by side."""
