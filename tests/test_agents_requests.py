"""The agent APIs' requests read as chat completions, and bad ones refused naming the field."""

import pytest

from mlx_radix_plugin.agents import generation as g
from mlx_radix_plugin.agents import messages, responses

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_a_messages_request_reads_as_chat_messages_with_tool_calls_and_results():
    c = messages.conversation(
        {
            "model": "claude-x",
            "max_tokens": 20,
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "stop_sequences": ["END"],
            "temperature": 0.0,
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": ""},
                        {"type": "text", "text": "Let me look."},
                        {
                            "type": "tool_use",
                            "id": "t1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
        }
    )
    call = {
        "id": "t1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert c.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "hm",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "Sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert c.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": WEATHER["description"],
            },
        }
    ]
    assert (c.sampling.max_tokens, c.sampling.temperature, c.sampling.stop) == (20, 0.0, ["END"])


OK_MESSAGES = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "change, param",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"model": 3}, "model"),
        ({"temperature": 1.5}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages.0.content.0.type",
        ),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages.0.content.0"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}
                ]
            },
            "messages.0.content.0.tool_use_id",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "messages.1.role",
        ),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tools": [{"type": "web_search_20250305", "name": "web"}]}, "tools.0.type"),
        ({"tool_choice": {"type": "some"}}, "tool_choice.type"),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"system": 5}, "system"),
        ({"cache_salt": ""}, "cache_salt"),
    ],
)
def test_a_bad_messages_request_is_refused_naming_the_field(change, param):
    body = {k: v for k, v in {**OK_MESSAGES, **change}.items() if v is not None}
    with pytest.raises(g.ApiError) as e:
        messages.conversation(body)
    assert (e.value.status, e.value.param) == (400, param)
    assert str(e.value).startswith(param)
    assert messages.error_body(e.value)["error"]["type"] == "invalid_request_error"


def test_a_responses_request_reads_as_chat_messages_and_continues_a_remembered_one():
    body = {
        "model": "gpt-x",
        "instructions": "Be brief.",
        "tools": [
            {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}
        ],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hm"}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        ],
    }
    c = responses.conversation(body)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert c.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "hm", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    ]
    assert c.history == c.messages[1:]  # instructions are not carried to the next response
    responses.remembered.put("resp_test", c.history + [{"role": "assistant", "content": "Sunny."}])
    follow = responses.conversation(
        {"model": "gpt-x", "previous_response_id": "resp_test", "input": "Thanks"}
    )
    assert follow.messages == c.history + [
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
    ]


OK_RESPONSES = {"model": "m", "input": "hi"}


@pytest.mark.parametrize(
    "change, param",
    [
        ({"input": ""}, "input"),
        ({"input": 5}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]},
            "input.0.call_id",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
            "input.0.arguments",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0"),
        ({"previous_response_id": "resp_never"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"top_p": 2}, "top_p"),
    ],
)
def test_a_bad_responses_request_is_refused_naming_the_field(change, param):
    with pytest.raises(g.ApiError) as e:
        responses.conversation({**OK_RESPONSES, **change})
    assert (e.value.status, e.value.param) == (400, param)
    assert responses.error_body(e.value)["error"]["param"] == param


def test_remembered_responses_forget_the_oldest_first():
    store = responses._Remembered(2)
    for name in ("a", "b", "c"):
        store.put(name, [{"role": "user", "content": name}])
    assert [store.get(n) is not None for n in ("a", "b", "c")] == [False, True, True]
