"""Where the generation thread's decode time goes (engine/step_clock.py), and the bench's
per-step parts from two readings of the stats."""

import time

from mlx_radix_plugin import KVPool, RadixPromptCache
from mlx_radix_plugin.engine.generator import RadixBatchGenerator
from mlx_radix_plugin.engine.step_clock import PARTS, StepClock
from mlx_radix_plugin.tools.gpu_bench import step_parts


def test_the_parts_add_up_to_the_decoding_calls_and_the_gaps_between_them(loaded):
    model, tok = loaded("llama")
    clock = StepClock()
    pool = KVPool.for_model(model, page_size=4, pool_tokens=1024)
    engine = RadixBatchGenerator(
        model, RadixPromptCache(pool), completion_batch_size=4, clock=clock
    )
    engine.insert([tok.encode("Once upon a time"), tok.encode("Hi")], max_tokens=[12, 12])
    while not len(engine._generation_batch):
        engine.next()
    before = dict(clock.seconds), clock.steps
    start = time.perf_counter()
    for _ in range(6):
        engine.next()
        time.sleep(0.01)  # the server's own work between calls: counted as outside
    wall = time.perf_counter() - start - 0.01  # the last gap is not counted yet
    engine.close()
    spent = {k: clock.seconds[k] - before[0][k] for k in PARTS}
    assert clock.steps - before[1] == 6
    assert spent["outside"] >= 5 * 0.01
    assert all(v >= 0 for v in spent.values())
    assert abs(sum(spent.values()) - wall) < 0.005
    stats = clock.stats()
    assert set(stats["decode_step_seconds"]) == set(PARTS) and stats["decode_steps_timed"] >= 6


def test_a_call_that_does_not_decode_stops_the_count_of_the_gap_after_it():
    clock = StepClock()
    clock.begin_call()
    clock.end_call(decoded=False)
    time.sleep(0.02)
    clock.begin_call()
    clock.end_call(decoded=True)
    assert clock.seconds["outside"] == 0 and clock.steps == 1


def test_step_parts_are_per_step_ms_between_two_readings():
    seconds = dict.fromkeys(PARTS, 0.0)
    before = {"decode_step_seconds": seconds, "decode_steps_timed": 10}
    spent = {**seconds, "launch": 0.2, "build": 0.1}
    after = {"decode_step_seconds": spent, "decode_steps_timed": 20}
    parts = step_parts(before, after)
    assert parts["launch"] == 20.0 and parts["build"] == 10.0 and parts["step"] == 30.0
    assert parts["steps"] == 10
    assert step_parts(None, after) is None  # stock's server has no such stats
    assert step_parts(before, before) is None  # nothing timed in between


def test_a_part_counts_its_time_less_the_parts_inside_it_and_only_for_decoding_calls():
    clock = StepClock()
    clock.begin_call()
    with clock.part("batch"):
        time.sleep(0.02)
        clock.add("launch", 0.015)  # a part inside it: not the batch's
    clock.end_call(decoded=True)
    assert 0.004 <= clock.seconds["batch"] < 0.015 and clock.seconds["launch"] == 0.015
    clock.begin_call()
    with clock.part("batch"):
        time.sleep(0.01)
    clock.end_call(decoded=False)  # a prefill-only call: none of it counts
    assert clock.seconds["batch"] < 0.015 and clock.steps == 1


def test_step_profile_shows_the_engines_parts_of_a_step_and_stocks_has_none(tmp_path):
    """``step_profile`` puts the engine's clock beside its own split of a step: the parts of
    the measured steps, which add up to about the step's wall time."""
    import json

    from mlx_radix_plugin.tools import step_profile

    out = tmp_path / "rows.json"
    args = ["--rows", "2", "--modes", "stock,off", "--steps", "6", "--json", str(out)]
    assert step_profile.main(args) == 0
    stock, engine = json.loads(out.read_text())["rows"]
    assert stock["mode"] == "stock" and "engine_ms" not in stock
    parts = engine["engine_ms"]
    assert set(parts) == set(PARTS) and all(v >= 0 for v in parts.values())
    assert parts["build"] > 0 and parts["launch"] > 0


def test_step_profile_reads_each_rows_log_probability_as_the_server_does(monkeypatch):
    """Every measured step reads each response's ``logprobs[token]`` to the host, stock's and
    the engine's alike: mlx_lm.server's generation thread does at every step, and leaving it
    out left stock's reads (a slice evaluated a row) uncounted."""
    import mlx.core as mx

    from mlx_radix_plugin.tools import step_profile

    read = []
    real = step_profile._read_as_the_server

    def recorded(responses):
        real(responses)
        read.append([(r.uid, r.token) for r in responses])

    monkeypatch.setattr(step_profile, "_read_as_the_server", recorded)
    assert step_profile.main(["--rows", "2", "--modes", "stock,off", "--steps", "4"]) == 0
    decoding = [step for step in read if len(step) == 2]
    assert len(decoding) >= 2 * (4 + 8)  # both modes' measured steps and their 8 before

    class Row:  # a response's logprobs: what ``[token].item()`` touched
        def __init__(self):
            self.items = []

        def __getitem__(self, token):
            self.items.append(token)
            return mx.array(0.5)

    rows = [Row(), Row()]
    responses = [type("R", (), {"logprobs": row, "token": t})() for row, t in zip(rows, (3, 7))]
    real(responses)
    assert [row.items for row in rows] == [[3], [7]]
