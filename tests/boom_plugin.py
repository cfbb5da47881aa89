"""A plugin whose batch generator fails a decode step of any request asking for 13 tokens
(run inside a test server, to check that the server goes on serving after a failed step)."""

import sys

from mlx_lm.generate import BatchGenerator
from mlx_lm_hooks.hookspecs import hookimpl

ARMED_MAX_TOKENS = 13
FAIL_AFTER = 3  # tokens the armed request streams before its step fails


class FailingBatchGenerator(BatchGenerator):
    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self.armed: dict[int, int] = {}  # uid -> tokens generated

    def insert_segments(self, segments, max_tokens=None, *args, **kwargs):
        uids = super().insert_segments(segments, max_tokens, *args, **kwargs)
        for uid, n in zip(uids, max_tokens or []):
            if n == ARMED_MAX_TOKENS:
                self.armed[uid] = 0
        return uids

    def next(self):
        prompt_responses, responses = super().next()
        for r in responses:
            if r.uid in self.armed:
                self.armed[r.uid] += 1
                if self.armed[r.uid] > FAIL_AFTER:
                    raise RuntimeError("injected failure in a decode step")
        return prompt_responses, responses


class Boom:
    @hookimpl
    def mlx_lm_batch_generator(self, model, kwargs):
        return FailingBatchGenerator(model, **kwargs)


def main() -> None:
    """``python boom_plugin.py [mlx_lm.server args]``: serve with only this plugin active."""
    from mlx_lm_hooks.plugins import get_plugin_manager
    from mlx_lm_hooks.server import serve

    pm = get_plugin_manager()
    pm.register(Boom(), name="boom")
    serve([], sys.argv[1:], pm)


if __name__ == "__main__":
    main()
