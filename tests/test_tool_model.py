"""The scripted tool-calling model of tiny_models: its greedy output, and a tool round trip
through mlx_lm.server, stock and with the radix plugin."""

import json

import pytest
from servers import Server, free_port, mlx_lm_server, server_env
from tiny_models import (
    SCRIPT_LOGIT,
    TOOL_ANSWER,
    TOOL_CALL,
    TOOL_CALL_TEXT,
    TOOL_SCHEMA,
    build_tool_model,
)

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
RESULT = '{"temperature": 21, "sky": "clear"}'
GREEDY = {"max_tokens": 32, "temperature": 0.0}


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("models") / "tool")


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-cache")


def with_result(call: dict) -> list[dict]:
    """QUESTION, the assistant's ``call`` (an OpenAI tool call) and the tool's result."""
    return [
        *QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call.get("id", "0"), "content": RESULT},
    ]


def test_greedy_output_calls_the_tool_then_answers(tool_model):
    import mlx.core as mx
    from mlx_lm import generate, load

    model, tokenizer = load(str(tool_model))
    assert tokenizer.has_tool_calling
    assert tokenizer.tool_parser.__module__ == "mlx_lm.tool_parsers.json_tools"
    assert tokenizer.tool_call_start == "<tool_call>"
    assert len(tokenizer.tool_call_start_tokens) == 1
    assert len(tokenizer.tool_call_end_tokens) == 1
    assert len(tokenizer.encode(TOOL_CALL_TEXT, add_special_tokens=False)) == 1
    assert json.loads(TOOL_CALL_TEXT) == TOOL_CALL

    def reply(messages: list[dict]) -> tuple[str, list[int]]:
        prompt = tokenizer.apply_chat_template(
            messages, tools=[TOOL_SCHEMA], add_generation_prompt=True
        )
        return generate(model, tokenizer, prompt, max_tokens=32), prompt

    text, prompt = reply(QUESTION)
    assert text == "<tool_call>" + TOOL_CALL_TEXT + "</tool_call>"
    rendered = tokenizer.decode(prompt)
    assert rendered.endswith("<|user|>Weather in Paris?</s><|assistant|>")
    assert '"name": "get_weather"' in rendered  # the tools, in the system part

    call = {"type": "function", "function": TOOL_CALL}  # arguments as a dict, as the server
    text, prompt = reply(with_result(call))
    assert text == TOOL_ANSWER
    rendered = tokenizer.decode(prompt)
    assert rendered.endswith(
        '<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        f"</tool_call></s><|tool|><tool_response>{RESULT}</tool_response></s><|answer|>"
    )
    # Arguments as a JSON string render the same.
    string_args = {"function": {**TOOL_CALL, "arguments": json.dumps(TOOL_CALL["arguments"])}}
    assert tokenizer.decode(
        tokenizer.apply_chat_template(with_result(string_args), tools=[TOOL_SCHEMA])
    ) == tokenizer.decode(tokenizer.apply_chat_template(with_result(call), tools=[TOOL_SCHEMA]))

    # Each step of both scripts wins by a wide margin, whatever came before it.
    steps = [
        ["<|assistant|>", "<tool_call>", TOOL_CALL_TEXT, "</tool_call>", "</s>"],
        ["<|answer|>", TOOL_ANSWER, "</s>"],
    ]
    for step in steps:
        ids = [t for s in step for t in tokenizer.encode(s, add_special_tokens=False)]
        logits = model(mx.array([ids]))
        top2 = mx.topk(logits[0, :-1], 2, axis=-1)
        assert mx.argmax(logits[0, :-1], axis=-1).tolist() == ids[1:]
        gaps = (mx.max(top2, axis=-1) - mx.min(top2, axis=-1)).tolist()
        assert min(gaps) > SCRIPT_LOGIT / 2, gaps


@pytest.mark.parametrize("plugin", ["stock", "radix"])
def test_tool_round_trip_through_server(plugin, tool_model, hf_cache, tmp_path):
    args = ("--plugin", "radix") if plugin == "radix" else ()
    port = free_port()
    cmd = mlx_lm_server(*args, "--model", str(tool_model), "--port", str(port))
    with Server(cmd, server_env(hf_cache), port, tmp_path / "log") as server:
        ask = {"messages": QUESTION, "tools": [TOOL_SCHEMA], **GREEDY}
        r = server.post("/v1/chat/completions", ask)
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] is None  # the call's markup never reaches the content
        [call] = message["tool_calls"]
        assert call["type"] == "function" and call["id"]
        assert call["function"]["name"] == TOOL_CALL["name"]
        # Arguments come back as a JSON string (json.dumps of the parsed call).
        assert json.loads(call["function"]["arguments"]) == TOOL_CALL["arguments"]

        events = [e for e in server.stream("/v1/chat/completions", ask) if e["choices"]]
        deltas = [e["choices"][0]["delta"] for e in events]
        assert "".join(d.get("content") or "" for d in deltas) == ""
        [streamed] = [c for d in deltas for c in d.get("tool_calls") or []]
        assert streamed["index"] == 0 and streamed["function"]["name"] == TOOL_CALL["name"]
        assert json.loads(streamed["function"]["arguments"]) == TOOL_CALL["arguments"]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

        # The follow-up: the assistant's message as the server sent it, then the result.
        follow = {**ask, "messages": [*QUESTION, message, with_result(call)[-1]]}
        r = server.post("/v1/chat/completions", follow)
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["choices"][0]["message"]["content"] == TOOL_ANSWER
        assert "tool_calls" not in r["choices"][0]["message"]
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        events = [e for e in server.stream("/v1/chat/completions", follow) if e["choices"]]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        assert text == TOOL_ANSWER
        assert events[-1]["choices"][0]["finish_reason"] == "stop"

        status, stats = server.get("/v1/cache/stats")
        if plugin == "radix":
            stats = json.loads(stats)
            assert status == 200 and stats["fallback"] is None and stats["hits"] >= 1
        else:
            assert status == 404
