"""The agent APIs end to end: the official ``anthropic`` and ``openai`` SDKs, as a user
drives them, against mlx_lm.server with the radix plugin and with the agents plugin alone
(stock's prompt cache), on the scripted tool-calling model of tiny_models."""

import contextlib
import http.client
import json

import anthropic
import openai
import pytest
from servers import Server, free_port, mlx_lm_server, server_env
from tiny_models import TOOL_ANSWER, TOOL_CALL, build_tool_model

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
QUESTION = "Weather in Paris?"
RESULT = '{"temperature": 21, "sky": "clear"}'


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-cache")


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("models") / "tool")


@pytest.fixture(scope="module", params=["radix", "agents"])
def server(request, tool_model, hf_cache, tmp_path_factory):
    port = free_port()
    cmd = mlx_lm_server("--plugin", request.param, "--model", str(tool_model), "--port", str(port))
    log = tmp_path_factory.mktemp("log") / "server.log"
    with Server(cmd, server_env(hf_cache), port, log) as s:
        yield s
        assert "Traceback" not in s.output()


def anthropic_client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused")


def openai_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused")


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_messages_tool_round_trip_with_the_anthropic_sdk(server, streamed):
    client = anthropic_client(server)
    # The SDK has no sampling arguments any more; the server samples greedily by default.
    ask = dict(model="claude-sonnet-4-5", max_tokens=32, tools=[WEATHER])

    def create(messages):
        if not streamed:
            return client.messages.create(messages=messages, **ask)
        with client.messages.stream(messages=messages, **ask) as stream:
            kinds = [event.type for event in stream]
            message = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert "message_delta" in kinds and "content_block_stop" in kinds
        return message

    history = [{"role": "user", "content": QUESTION}]
    first = create(history)
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert (use.type, use.name, use.input) == (
        "tool_use",
        TOOL_CALL["name"],
        TOOL_CALL["arguments"],
    )
    assert first.usage.output_tokens == 4  # <tool_call>, the call, </tool_call>, </s>

    history += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}],
        },
    ]
    second = create(history)
    assert second.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in second.content] == [("text", TOOL_ANSWER)]
    # Turn 2 reads turn 1's prompt from the cache; uncached input is the rest.
    assert second.usage.cache_read_input_tokens > 0
    prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert prompt > first.usage.input_tokens + first.usage.cache_read_input_tokens


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_responses_tool_round_trip_with_the_openai_sdk(server, streamed):
    client = openai_client(server)
    tool = {"type": "function", "name": WEATHER["name"], "parameters": WEATHER["input_schema"]}
    ask = dict(model="gpt-5", max_output_tokens=32, temperature=0.0, tools=[tool])

    def create(**kwargs):
        if not streamed:
            return client.responses.create(**kwargs, **ask)
        with client.responses.stream(**kwargs, **ask) as stream:
            kinds = [event.type for event in stream]
            response = stream.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        return response

    first = create(input=QUESTION, instructions="Use the tools.")
    [call] = first.output
    assert (call.type, call.name) == ("function_call", TOOL_CALL["name"])
    assert json.loads(call.arguments) == TOOL_CALL["arguments"]
    assert first.status == "completed"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    # The conversation continued two ways: by the server's memory, and sent whole.
    kept = create(input=[result], previous_response_id=first.id)
    sent = create(input=[{"role": "user", "content": QUESTION}, call.model_dump(), result])
    for second in (kept, sent):
        assert second.output_text == TOOL_ANSWER
        assert second.usage.input_tokens_details.cached_tokens > 0
    assert kept.usage.input_tokens == sent.usage.input_tokens  # instructions are not carried


def test_count_tokens_counts_what_the_messages_route_prefills(server):
    client = anthropic_client(server)
    messages = [{"role": "user", "content": QUESTION}]
    counted = client.messages.count_tokens(model="m", messages=messages, tools=[WEATHER])
    answer = client.messages.create(model="m", max_tokens=8, messages=messages, tools=[WEATHER])
    usage = answer.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_count_tokens_reads_no_more_than_the_context_could_take(server):
    """A count_tokens body past what the model's context could hold (32 bytes a token, at
    least 1 MiB) is refused before it is tokenized (a 9 MB body took 19.5 s of a thread)."""
    big = {"role": "user", "content": "word " * 250_000}  # 1.25 MB
    with pytest.raises(anthropic.APIStatusError) as e:
        anthropic_client(server).messages.count_tokens(model="m", messages=[big])
    assert e.value.status_code == 413
    assert "holds more than this model's context takes" in e.value.body["error"]["message"]


def test_errors_come_in_each_api_shape_and_the_server_goes_on(server):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client(server).messages.create(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9"}]}],
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("messages.0.content.0.tool_use_id:")
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(server).responses.create(model="m", input="hi", previous_response_id="r1")
    assert e.value.body["param"] == "previous_response_id"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    with contextlib.closing(conn):
        conn.request("POST", "/v1/messages", b"{not json", {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert (r.status, json.loads(r.read())["error"]["type"]) == (400, "invalid_request_error")
    answer = anthropic_client(server).messages.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": QUESTION}]
    )
    assert answer.content[0].type == "tool_use"


def sse_events(server: Server, path: str, body: dict, stop_after: int | None = None) -> list:
    """The (event, data) pairs of a stream; hangs up after ``stop_after`` of them."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    with contextlib.closing(conn):
        conn.request("POST", path, json.dumps({**body, "stream": True}))
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
        events, name = [], None
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: ") :])))
                if stop_after is not None and len(events) >= stop_after:
                    break
        return events


@pytest.fixture(scope="module")
def plain_server(model_dirs, hf_cache, tmp_path_factory):
    """A model without tool calling, whose greedy answers run long."""
    port = free_port()
    cmd = mlx_lm_server(
        "--plugin", "radix", "--model", str(model_dirs["llama"]), "--port", str(port)
    )
    log = tmp_path_factory.mktemp("log") / "server.log"
    with Server(cmd, server_env(hf_cache), port, log) as s:
        yield s


def test_tools_for_a_model_without_tool_calling_get_a_400(plain_server):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client(plain_server).messages.create(
            model="m", max_tokens=4, tools=[WEATHER], messages=[{"role": "user", "content": "hi"}]
        )
    assert "no tool calling" in e.value.body["error"]["message"]


def test_a_stop_sequence_ends_the_answer_and_is_named(plain_server, model_dirs):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(model_dirs["llama"])
    messages = [{"role": "user", "content": "Once upon a time"}]
    # The same prompt as chat completions, for the answer's token ids: the server matches
    # stop sequences on tokens, so the stop is one token the answer holds, seen once.
    chat = plain_server.post(
        "/v1/chat/completions", {"messages": messages, "max_tokens": 40, "logprobs": True}
    )
    ids = [t["id"] for t in chat["choices"][0]["logprobs"]["content"]]
    full = chat["choices"][0]["message"]["content"]
    stop = next(
        word
        for i, t in enumerate(ids[3:], 3)
        if t not in ids[:i]
        and (word := tokenizer.decode([t])).isascii()
        and word.strip()
        and tokenizer.encode(word, add_special_tokens=False) == [t]
    )
    client = anthropic_client(plain_server)
    stopped = client.messages.create(
        model="m", max_tokens=40, messages=messages, stop_sequences=[stop]
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    text = stopped.content[0].text
    assert full.startswith(text) and len(text) < len(full)


def test_a_client_hanging_up_mid_stream_costs_one_log_line(plain_server):
    body = {
        "model": "m",
        "max_tokens": 400,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
    }
    head = sse_events(plain_server, "/v1/messages", body, stop_after=4)
    assert [name for name, _ in head[:2]] == ["message_start", "content_block_start"]
    # The server notices at its next write and goes on serving.
    events = sse_events(
        plain_server, "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 4}
    )
    assert events[-1][0] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    output = plain_server.output()
    assert output.count("hung up before its response ended") == 1
    assert "Traceback" not in output


def test_an_agent_session_is_served_from_the_pool_turn_over_turn(plain_server):
    """Each turn's prompt holds the last turn's prompt and reply, then a tool result: the
    pool serves at least all of the last prompt, whatever the reply's tokens became."""
    client = anthropic_client(plain_server)
    system = " ".join(["You are a coding agent with tools: read, write, run, search."] * 30)
    messages = [{"role": "user", "content": "Fix the failing test."}]
    previous_prompt = 0
    for turn in range(6):
        answer = client.messages.create(model="m", max_tokens=8, system=system, messages=messages)
        usage = answer.usage
        prompt = usage.input_tokens + usage.cache_read_input_tokens
        if turn:
            assert usage.cache_read_input_tokens >= previous_prompt, turn
        previous_prompt = prompt
        call = {"type": "tool_use", "id": f"toolu_{turn}", "name": "run", "input": {"n": turn}}
        text = "".join(b.text for b in answer.content if b.type == "text")
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": text}, call]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "ok"}],
            },
        ]


def test_a_request_shaped_like_claude_codes_is_served(server):
    """What Claude Code sends besides a plain request: a billing line first in the system
    prompt, a system message after the user's, a deferred and a server tool, thinking modes
    and context management; its answer calls the tool."""
    client = anthropic_client(server)
    deferred = dict(WEATHER, name="later", defer_loading=True)
    # Streamed, as Claude Code asks (the SDK streams a request for that many tokens).
    with client.messages.stream(
        model="claude-opus-5-5",
        max_tokens=128000,
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0.abc;"},
            {"type": "text", "text": "Use the tools.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "system", "content": "Working directory: /tmp"},
        ],
        tools=[WEATHER, deferred, {"type": "web_search_20250305", "name": "web_search"}],
        thinking={"type": "adaptive"},
        metadata={"user_id": "u"},
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "low"}},
    ) as stream:
        answer = stream.get_final_message()
    assert answer.stop_reason == "tool_use" and answer.content[0].name == TOOL_CALL["name"]


@pytest.fixture(scope="module")
def namespaced_server(hf_cache, tmp_path_factory):
    """The scripted model calling ``weather__get_weather``: a namespaced tool's flat name."""
    call = dict(TOOL_CALL, name="weather__" + TOOL_CALL["name"])
    model = build_tool_model(tmp_path_factory.mktemp("models") / "namespaced", call=call)
    port = free_port()
    cmd = mlx_lm_server("--plugin", "radix", "--model", str(model), "--port", str(port))
    log = tmp_path_factory.mktemp("log") / "server.log"
    with Server(cmd, server_env(hf_cache), port, log) as s:
        yield s


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_namespaced_call_goes_back_with_its_namespace(namespaced_server, streamed):
    """Codex's tools: functions grouped under a namespace, a hosted web search, developer
    messages; the call names the function and its namespace, as Codex routes it."""
    client = openai_client(namespaced_server)
    function = {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}
    ask = dict(
        model="gpt-5",
        max_output_tokens=32,
        temperature=0.0,
        tools=[
            {
                "type": "namespace",
                "name": "weather",
                "description": "Weather.",
                "tools": [function],
            },
            {"type": "web_search"},
        ],
        store=False,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="session-1",
    )

    def create(items):
        if not streamed:
            return client.responses.create(input=items, **ask)
        with client.responses.stream(input=items, **ask) as stream:
            for _ in stream:
                pass
            return stream.get_final_response()

    items = [
        {"role": "developer", "content": "You are Codex."},
        {"role": "user", "content": QUESTION},
    ]
    first = create(items)
    [call] = first.output
    assert (call.type, call.name, call.namespace) == ("function_call", "get_weather", "weather")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    second = create([*items, call.model_dump(exclude_none=True), result])
    assert second.output_text == TOOL_ANSWER
    assert second.usage.input_tokens_details.cached_tokens > 0
