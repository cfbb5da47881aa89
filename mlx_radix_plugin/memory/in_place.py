"""A decode step's K/V stored into the pool in place, on CUDA: one kernel an array.

MLX writes an array in place (a scatter reusing its buffer) only while nothing else holds
it, and a kernel still running holds its inputs. The shared path's decode steps read the
pool every step, so the next step's scatter would copy a whole pool array (12.9 GB for
Llama-3-8B on an H200): the engine waited for the step before to finish first
(``KVPool.settle``), and the device stood idle while the host encoded the next step.
Measured on the H200 (8B shape, bf16, one row, in process): 6.1 ms a step, of which 2.0
building the graph and 3.9 launching it, against a 5.1 ms bandwidth floor; the device ran
only once the host had launched (docs/benchmarking.md, "Stores in place on CUDA").

Here a kernel stores the rows through its input: the pool array is an input of the kernel,
never an output, so MLX neither copies it nor replaces it, and nothing waits. MLX does not
see the write, so only the stream orders it: on CUDA the kernels of one evaluation are nodes
of one command graph, with edges only from an array's writer to its readers, and a store has
no edge to a read of its rows in the same evaluation. So the kernel is launched with the step
that made its rows (``KVPool.take_marks``), whose reads are of the rows' earlier positions
(the step's own token is passed to the attention directly), and every later evaluation
reads after it; a store no step launched is launched before anything else touches the pool
(``KVPool.launch_stores``). tests/test_in_place.py holds the engine to this on the CPU,
each store landing at either end of the evaluation that launches it.

CUDA only, and only once ``check`` has compared it with MLX's scatter on this device for
the dtype; elsewhere (Metal, the CPU) the pool writes by scatter as before.
"""

from __future__ import annotations

import logging

import mlx.core as mx

log = logging.getLogger("mlx_radix")

THREADS = 256  # a block

# Inputs: pool, a one-row view of a pool array (rows, heads, dim), row-contiguous, whose
# buffer holds every row; idx (n,) integer rows of it; rows (n, W): the values, W = heads x
# dim. Output: done (1,), what the step evaluates to run the store.
_SOURCE = """
const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
if (i == 0) done[0] = 1;
if (i >= (int64_t)rows_shape[0] * W) return;
const int64_t r = i / W;
T* out = const_cast<T*>(pool);
out[(int64_t)idx[r] * W + (i - r * W)] = rows[i];
"""

# Whether to store in place: None decides by device (``available``); tests set it.
IN_PLACE: bool | None = None

_kernel = None
_checked: dict[mx.Dtype, bool] = {}


def _store_kernel():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="radix_pool_store",
            input_names=["pool", "idx", "rows"],
            output_names=["done"],
            source=_SOURCE,
            ensure_row_contiguous=True,
        )
    return _kernel


def head(array: mx.array) -> mx.array:
    """A one-row view of a pool array: what a kernel reading or writing any of its rows is
    given. MLX's CUDA backend ends a command graph once the inputs it has counted pass
    ``MLX_MAX_MB_PER_BUFFER`` (1,000 Mi elements on an H200), so a whole pool array given
    to a kernel a layer ended a graph at every layer: 3.9 ms launching a one-row step of
    the 8B shape against 2.0 with a small pool. A view counts its own elements; the kernel
    reads the rows past it, in the same buffer."""
    return array[:1]


def store(array: mx.array, idx: mx.array, rows: mx.array) -> mx.array:
    """Write ``rows`` ``(n, heads, dim)`` at rows ``idx`` of ``array``, in place; returns
    what to evaluate for it (the pool's arrays are unchanged objects)."""
    n = rows.shape[0]
    width = rows.shape[1] * rows.shape[2]
    return _store_kernel()(
        inputs=[head(array), idx, rows.reshape(n, width)],
        template=[("T", array.dtype), ("W", width)],
        grid=(max(1, -(-n * width // THREADS)) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )[0]


def available(dtype: mx.Dtype) -> bool:
    """Whether decode writes go in place here: CUDA, and ``check`` passed for ``dtype``."""
    if IN_PLACE is not None:
        return IN_PLACE
    if mx.default_device() == mx.cpu or not mx.cuda.is_available():
        return False
    return check(dtype)


def check(dtype: mx.Dtype) -> bool:
    """Whether ``store`` gives the scatter's result on this device for ``dtype``, rows left
    alone included; once per dtype, one log line where it fails."""
    if dtype in _checked:
        return _checked[dtype]
    ok = False
    try:
        key = mx.random.key(3)
        k1, k2 = mx.random.split(key)
        array = mx.random.normal((64, 4, 24), key=k1).astype(dtype)
        idx = mx.array([5, 63, 0, 17, 40], dtype=mx.int32)
        rows = mx.random.normal((5, 4, 24), key=k2).astype(dtype)
        want = array + 0  # a copy, scattered into and evaluated before the store runs
        want[idx] = rows
        mx.eval(array, want, rows)
        mx.eval(store(array, idx, rows))
        ok = bool(mx.array_equal(array, want).item())
        if not ok:
            log.warning("in-place pool writes differ from MLX's scatter here (%s): not used", dtype)
    except Exception as e:  # the kernel did not build or run here: the scatter writes
        log.warning("in-place pool writes unavailable (%s): %s", type(e).__name__, e)
    _checked[dtype] = ok
    return ok
