from mlx_lm_hooks import blas

blas.preload()  # before MLX is imported, as the mlx-radix command does

from .command import main  # noqa: E402

main()
