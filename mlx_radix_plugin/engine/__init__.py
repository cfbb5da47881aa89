"""The batch generator of the radix path: mlx-lm's own, with prefix-aware admission."""
