"""A plugin whose batch generator fails a decode step of any request asking for 13 tokens
(run inside a test server, to check that the server goes on serving after a failed step)."""

import sys

from mlx_lm.generate import BatchGenerator
from mlx_lm_hooks.hookspecs import hookimpl

ARMED_MAX_TOKENS = 13
FAIL_AFTER = 3  # tokens the armed request streams before its step fails


def arm(generator):
    """Make ``generator`` (mlx-lm's BatchGenerator or a plugin's) fail a decode step of any
    request asking for ARMED_MAX_TOKENS tokens, once it has streamed FAIL_AFTER."""
    armed: dict[int, int] = {}  # uid -> tokens generated
    insert_segments, step = generator.insert_segments, generator.next

    def insert(segments, max_tokens=None, *args, **kwargs):
        uids = insert_segments(segments, max_tokens, *args, **kwargs)
        for uid, n in zip(uids, max_tokens or []):
            if n == ARMED_MAX_TOKENS:
                armed[uid] = 0
        return uids

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
