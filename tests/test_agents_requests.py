"""The agent APIs' requests read as chat completions, and bad ones refused naming the field."""

import pytest

from mlx_radix_plugin.agents import fields, messages, responses
from mlx_radix_plugin.agents import generation as g

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
    assert c.tools.rendered == [
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
        ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"thinking": 5}, "thinking"),
        ({"thinking": {"budget_tokens": 9}}, "thinking"),
        ({"metadata": "x"}, "metadata"),
        ({"output_config": []}, "output_config"),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "system", "content": [{"type": "image"}]},
                ]
            },
            "messages.1.content.0.type",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "system", "content": [{"type": "tool_removal", "tool": "Cron"}]},
                ]
            },
            "messages.1.content.0.tool",
        ),
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
        ({"tools": [{"type": 5, "name": "web"}]}, "tools.0.type"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.name"),
        ({"tools": [dict(WEATHER, defer_loading="yes")]}, "tools.0.defer_loading"),
        ({"tool_choice": {"type": "some"}}, "tool_choice.type"),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"system": 5}, "system"),
        ({"cache_salt": ""}, "cache_salt"),
    ],
)
def test_a_bad_messages_request_is_refused_naming_the_field(change, param):
    body = {k: v for k, v in {**OK_MESSAGES, **change}.items() if v is not None}
    with pytest.raises(fields.ApiError) as e:
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
    stored = c.history + [{"role": "assistant", "content": "Sunny."}]
    responses.remembered.put(None, "resp_test", stored, 100)
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
        ({"tools": [{"type": "namespace", "name": "ns", "tools": {}}]}, "tools.0.tools"),
        ({"tools": [{"type": "namespace", "tools": []}]}, "tools.0.name"),
        ({"include": "reasoning.encrypted_content"}, "include"),
        ({"prompt_cache_key": 5}, "prompt_cache_key"),
        ({"client_metadata": "x"}, "client_metadata"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "patch", "input": 5}]},
            "input.0.input",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"top_p": 2}, "top_p"),
    ],
)
def test_a_bad_responses_request_is_refused_naming_the_field(change, param):
    with pytest.raises(fields.ApiError) as e:
        responses.conversation({**OK_RESPONSES, **change})
    assert (e.value.status, e.value.param) == (400, param)
    assert responses.error_body(e.value)["error"]["param"] == param


def test_remembered_responses_forget_the_oldest_first_by_count_and_by_bytes():
    store = responses._Remembered(2, 1000)
    for name in ("a", "b", "c"):
        store.put(None, name, [{"role": "user", "content": name}], 10)
    assert [store.get(None, n) is not None for n in ("a", "b", "c")] == [False, True, True]
    store.put(None, "big", [{"role": "user", "content": "x" * 990}], 995)
    assert [store.get(None, n) is not None for n in ("b", "c", "big")] == [False, False, True]


def test_a_remembered_response_continues_for_its_own_cache_salt_only():
    """Any holder of a response's id could continue another tenant's conversation."""
    store = responses._Remembered(8, 1000)
    store.put("tenant-a", "resp_1", [{"role": "user", "content": "secret"}], 10)
    assert store.get("tenant-a", "resp_1") is not None
    assert store.get("tenant-b", "resp_1") is None and store.get(None, "resp_1") is None
    responses.remembered.put("tenant-a", "resp_salted", [{"role": "user", "content": "s"}], 10)
    follow = {"model": "m", "previous_response_id": "resp_salted", "input": "hi"}
    with pytest.raises(fields.ApiError, match="remembered by this server for this cache_salt"):
        responses.conversation(follow)
    continued = responses.conversation({**follow, "cache_salt": "tenant-a"})
    assert continued.messages[0]["content"] == "s"


# Claude Code's request, in the shape it sends (docs/agents.md), with short texts.
BILLING = "x-anthropic-billing-header: cc_version=2.1.332.dcb; cc_entrypoint=sdk-cli;"
DEFERRED = {
    "name": "WebFetch",
    "description": "Fetch a page",
    "input_schema": {"type": "object", "properties": {"url": {"type": "string"}}},
    "defer_loading": True,
}


def claude_code_request(**change) -> dict:
    body = {
        "model": "claude-opus-5-5",
        "max_tokens": 128000,
        "stream": True,
        "system": [
            {"type": "text", "text": BILLING},
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is in notes.txt?"}]},
            {"role": "system", "content": "# Environment\ncwd: /tmp/work"},
        ],
        "tools": [WEATHER, DEFERRED, {"type": "web_search_20250305", "name": "web_search"}],
        "metadata": {"user_id": '{"device_id": "d"}'},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
    }
    return {**body, **change}


def test_claude_codes_request_is_served_without_its_billing_line_or_hosted_tools():
    c = messages.conversation(claude_code_request())
    assert c.messages == [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "What is in notes.txt?"},
        {"role": "system", "content": "# Environment\ncwd: /tmp/work"},
    ]
    # The deferred tool is callable but not rendered; the server tool is left out.
    assert [t["function"]["name"] for t in c.tools.rendered] == ["get_weather"]
    assert sorted(c.tools.callable) == ["WebFetch", "get_weather"]
    assert c.sampling.max_tokens == 128000
    kept = messages.conversation(claude_code_request(), billing_header=True)
    assert kept.messages[0]["content"] == BILLING + "You are an agent."


def test_a_changed_billing_line_leaves_the_prompt_as_it_was():
    changed = claude_code_request()
    changed["system"][0] = {"type": "text", "text": BILLING.replace("sdk-cli", "cli")}
    assert messages.conversation(changed).messages == (
        messages.conversation(claude_code_request()).messages
    )


def test_tool_search_and_tool_changes_render_the_tools_they_load_in_place():
    history = claude_code_request()["messages"] + [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [
                        {"type": "tool_reference", "tool_name": "WebFetch"},
                        {"type": "image", "source": {"type": "base64", "data": "AAAA"}},
                    ],
                }
            ],
        },
        {
            "role": "system",
            "content": [
                {
                    "type": "tool_addition",
                    "tool": {"type": "tool_definition", "definition": dict(WEATHER, name="Cron")},
                },
                {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Cron"}},
            ],
        },
    ]
    c = messages.conversation(claude_code_request(messages=history))
    result, change = c.messages[-2:]
    loaded = c.tools.callable["WebFetch"].render()
    assert result == {
        "role": "tool",
        "tool_call_id": "t1",
        "content": f"Tool loaded: {loaded}\n[an image: this model reads text only]",
    }
    assert change["role"] == "system"
    assert change["content"].startswith('Tool added: {"type": "function"')
    assert change["content"].endswith("Tool removed: Cron\n")
    assert "Cron" in c.tools.callable  # a call to an added tool is parsed as one


CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Sub-agents.",
        "tools": [
            {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}},
            {"type": "custom", "name": "notes", "description": "Free text."},
        ],
    },
    {"type": "web_search", "external_web_access": False},
]


def codex_request(**change) -> dict:
    body = {
        "model": "mlx-local",
        "stream": True,
        "input": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are Codex."}],
            },
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Skills."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "<env/>"}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ],
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a249c0",
        "client_metadata": {"thread_id": "01a249c0"},
    }
    return {**body, **change}


def test_codexs_request_offers_namespaced_tools_by_their_flat_names():
    c = responses.conversation(codex_request())
    assert [m["role"] for m in c.messages] == ["system", "system", "user", "user"]
    assert [t["function"]["name"] for t in c.tools.rendered] == [
        "exec_command",
        "multi_agent_v1__spawn_agent",
        "multi_agent_v1__notes",
    ]
    notes = c.tools.callable["multi_agent_v1__notes"]
    assert notes.custom and notes.function["function"]["parameters"]["required"] == ["input"]


def test_calls_go_back_as_the_client_named_the_tool():
    c = responses.conversation(codex_request())
    spawn = responses._call_item(g.ToolCall("multi_agent_v1__spawn_agent", {"x": 1}, "c1"), c.tools)
    assert {k: spawn[k] for k in ("type", "name", "namespace", "arguments", "call_id")} == {
        "type": "function_call",
        "name": "spawn_agent",
        "namespace": "multi_agent_v1",
        "arguments": '{"x": 1}',
        "call_id": "c1",
    }
    notes = responses._call_item(g.ToolCall("multi_agent_v1__notes", {"input": "hm"}), c.tools)
    assert (notes["type"], notes["name"], notes["input"]) == ("custom_tool_call", "notes", "hm")
    plain = responses._call_item(g.ToolCall("exec_command", {}), c.tools)
    assert "namespace" not in plain and plain["name"] == "exec_command"
    # Sent back in the next request's input, each call reads as the model wrote it.
    outputs = [
        {"type": "function_call_output", "call_id": spawn["call_id"], "output": "ok"},
        {"type": "custom_tool_call_output", "call_id": notes["call_id"], "output": "ok"},
    ]
    sent = [*codex_request()["input"], spawn, notes, plain, *outputs]
    again = responses.conversation(codex_request(input=sent))
    [assistant] = [m for m in again.messages if m["role"] == "assistant"]
    assert [c["function"] for c in assistant["tool_calls"]] == [
        {"name": "multi_agent_v1__spawn_agent", "arguments": {"x": 1}},
        {"name": "multi_agent_v1__notes", "arguments": {"input": "hm"}},
        {"name": "exec_command", "arguments": {}},
    ]
