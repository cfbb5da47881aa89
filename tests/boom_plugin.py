"""A plugin whose batch generator fails a decode step of any request asking for 13 tokens, the
second prompt pass of any asking for 17 as an allocation would, and gives any asking for 19 a
logits processor that raises once FAIL_AFTER tokens are out (run inside a test server, to
check that the server goes on serving after a failed step, and a row fails alone)."""

import sys

from mlx_lm.generate import BatchGenerator
from mlx_lm_hooks.hookspecs import hookimpl

ARMED_MAX_TOKENS = 13
FAIL_AFTER = 3  # tokens the armed request streams before its step fails
ARMED_PROMPT_MAX_TOKENS = 17
ARMED_ROW_MAX_TOKENS = 19
ROW_FAILURE = "injected failure in a logits processor"
OUT_OF_MEMORY = "cudaMallocAsync(&data, size, stream) failed: out of memory (injected)"


def arm(generator):
    """Make ``generator`` (mlx-lm's BatchGenerator or a plugin's) fail a decode step of any
    request asking for ARMED_MAX_TOKENS tokens, once it has streamed FAIL_AFTER."""
    armed: dict[int, int] = {}  # uid -> tokens generated
    prompt_armed: set[int] = set()
    insert_segments, step = generator.insert_segments, generator.next

    def insert(segments, max_tokens=None, *args, **kwargs):
        processors = kwargs.get("logits_processors")
        if processors is not None:
            kwargs["logits_processors"] = [
                [*row, _failing_processor()] if n == ARMED_ROW_MAX_TOKENS else row
                for n, row in zip(max_tokens, processors)
            ]
        uids = insert_segments(segments, max_tokens, *args, **kwargs)
        for uid, n in zip(uids, max_tokens or []):
            if n == ARMED_MAX_TOKENS:
                armed[uid] = 0
            if n == ARMED_PROMPT_MAX_TOKENS:
                prompt_armed.add(uid)
        return uids

    passes: dict[int, int] = {}  # uid -> prompt passes it was in
    batch = generator._prompt_batch
    prompt = batch.prompt

    def prompt_pass(tokens):
        # The second pass of an armed request fails as MLX's allocator does: in its
        # evaluation, after the pass's graph is built (its K/V staged for the pool).
        armed_now = [u for u in batch.uids if u in prompt_armed]
        for u in armed_now:
            passes[u] = passes.get(u, 0) + 1
        if not any(passes[u] == 2 for u in armed_now):
            return prompt(tokens)
        model = batch.model

        def failing(*args, **kwargs):
            model(*args, **kwargs)
            raise RuntimeError(OUT_OF_MEMORY)

        batch.model = failing
        try:
            return prompt(tokens)
        finally:
            batch.model = model

    batch.prompt = prompt_pass

    def next_step():
        prompt_responses, responses = step()
        for r in responses:
            if r.uid in armed:
                armed[r.uid] += 1
                if armed[r.uid] > FAIL_AFTER:
                    raise RuntimeError("injected failure in a decode step")
        return prompt_responses, responses

    generator.insert_segments, generator.next = insert, next_step
    return generator


def _failing_processor():
    """A logits processor that raises at its call after FAIL_AFTER calls: the row's first
    FAIL_AFTER tokens go out, then its step's graph cannot be built."""
    calls = [0]

    def processor(tokens, logits):
        calls[0] += 1
        if calls[0] > FAIL_AFTER:
            raise ValueError(ROW_FAILURE)
        return logits

    return processor


class Boom:
    @hookimpl(hookwrapper=True)
    def mlx_lm_batch_generator(self, model, kwargs):
        outcome = yield
        generator = outcome.get_result() or BatchGenerator(model, **kwargs)
        outcome.force_result(arm(generator))


def main() -> None:
    """``python boom_plugin.py [PLUGIN,...] [mlx_lm.server args]``: serve with this plugin
    and the named ones active."""
    from mlx_lm_hooks.plugins import get_plugin_manager
    from mlx_lm_hooks.server import serve

    pm = get_plugin_manager()
    pm.register(Boom(), name="boom")
    names = sys.argv[1].split(",") if not sys.argv[1].startswith("-") else []
    serve(names, sys.argv[1 + bool(names) :], pm)


if __name__ == "__main__":
    main()
