"""Room in MLX's cache of freed buffers (memory/freed_buffers.py): a cache filled to the
server's limit keeps no buffer a step frees, and a step that starts with room keeps them."""

import mlx.core as mx
import pytest
from test_generation import no_eos
from test_shared_prefix import admit, decode, radix, stock_run

from mlx_radix_plugin.engine.generator import RadixBatchGenerator
from mlx_radix_plugin.memory.freed_buffers import FreedBuffers

LIMIT = 16 << 20


@pytest.fixture
def limit():
    """MLX's cache emptied and limited to ``LIMIT`` for the test, then as it was."""
    mx.clear_cache()
    before = mx.set_cache_limit(LIMIT)
    yield LIMIT
    mx.set_cache_limit(before)
    mx.clear_cache()


def fill(limit: int) -> None:
    """The cache to its limit with buffers nothing uses again (a prefill's temporaries)."""
    held = [mx.zeros((1 << 18,), dtype=mx.float32) + i for i in range(limit // (1 << 20) + 4)]
    mx.eval(held)
    del held


def freed_and_kept(nbytes: int) -> int:
    """Bytes the cache gained when an array of ``nbytes`` was freed (a size no cached
    buffer fits, so that making it takes none from the cache)."""
    x = mx.ones((nbytes // 4,), dtype=mx.float32) * 2
    mx.eval(x)
    before = mx.get_cache_memory()
    del x
    return mx.get_cache_memory() - before


def test_a_full_cache_keeps_nothing_a_step_frees_until_a_step_makes_room(limit):
    fill(limit)
    assert mx.get_cache_memory() > limit - (1 << 20)
    assert freed_and_kept(3 << 20) == 0  # MLX frees it for real: the next step allocates again

    freed = FreedBuffers(limit)
    freed.make_room()
    assert mx.get_cache_memory() <= limit - 2 * freed.room
    assert mx.set_cache_limit(limit) == limit  # the server's limit is back
    assert freed_and_kept(3 << 20) == 3 << 20
    assert freed.trims == 1

    freed.make_room()  # room left: nothing to do
    assert freed_and_kept(3 << 20) == 3 << 20
    assert freed.trims == 1


def test_a_cache_with_room_is_left_as_it_is(limit):
    x = mx.zeros((1 << 20,), dtype=mx.float32) + 1
    mx.eval(x)
    del x
    cached = mx.get_cache_memory()
    freed = FreedBuffers(limit)
    freed.make_room()
    assert mx.get_cache_memory() == cached
    assert freed.trims == 0


def test_a_limit_below_zero_is_refused():
    with pytest.raises(ValueError, match="-1"):
        FreedBuffers(-1)


def test_the_engine_trims_a_full_cache_once_and_its_steps_then_reuse_their_buffers(loaded, limit):
    """Decoding with the cache filled to the server's limit: the first call trims it, the
    steps after find room (their buffers go back to the cache and come out again), and the
    tokens are stock's."""
    model, tok = loaded("llama")
    prompts = [tok.encode("Once upon a time, in a quiet town by the sea,"), tok.encode("Hi")]
    expected, _ = stock_run(model, tok, prompts, [12] * 2)
    rpc = radix(model)
    rpc.pool.freed_buffers = freed = FreedBuffers(limit)
    gen = RadixBatchGenerator(model, rpc)
    uids = admit(gen, rpc, prompts, [12] * 2, logits_processors=[[no_eos(tok.eos_token_ids)]] * 2)
    fill(limit)
    assert decode(gen, uids, 24) == expected
    assert freed.trims == 1
    assert mx.get_cache_memory() <= limit - freed.room
