"""Sampling a batch cannot run is refused before the request's row exists
(mlx_lm_hooks/validation.py): alone, with HTTP 400 naming the field, on every route, while
another client's stream in flight goes on to stock's answer."""

import threading
from types import SimpleNamespace

import pytest
from mlx_lm_hooks import validation
from mlx_lm_hooks.validation import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, InvalidSampling
from servers import NO_EOS, mlx_lm_server
from test_server import hf_cache, start  # noqa: F401 - fixtures

VOCAB = 1024


def arguments(stop=(), logit_bias=None, seed=None, **sampling):
    values = dict(temperature=0.7, top_p=1.0, top_k=0, min_p=0.0, xtc_probability=0.0)
    values.update(xtc_threshold=0.0, **sampling)
    logits = SimpleNamespace(
        logit_bias=logit_bias, repetition_penalty=0.0, presence_penalty=0.0, frequency_penalty=0.0
    )
    sampling = SimpleNamespace(**values)
    return SimpleNamespace(sampling=sampling, logits=logits, stop_words=list(stop), seed=seed)


@pytest.mark.parametrize(
    "args, message",
    [
        (arguments(top_k=VOCAB), "top_k: must be between 0 (off) and 1023 (the model has 1024"),
        (arguments(top_k=-1), "top_k: must be between 0 (off) and 1023"),
        (arguments(temperature=float("nan")), "temperature: must be a finite number of at least 0"),
        (arguments(temperature=float("inf")), "temperature: must be a finite number"),
        (arguments(top_p=1.5), "top_p: must be a number from 0 to 1, got 1.5"),
        (arguments(min_p=float("nan")), "min_p: must be a number from 0 to 1"),
        (arguments(logit_bias={VOCAB: 1.0}), "logit_bias: token id 1024 is not one of"),
        (arguments(logit_bias={-3: 1.0}), "logit_bias: token id -3 is not one of"),
        (arguments(logit_bias={5: float("inf")}), "logit_bias: token 5's bias must be a finite"),
        (arguments(stop=["x"] * (MAX_STOP_SEQUENCES + 1)), "stop: at most 256 stop sequences"),
        (arguments(stop=["ok", "x" * (MAX_STOP_CHARS + 1)]), "stop.1: a stop sequence is at most"),
        (arguments(stop=["ok", 5]), "stop.1: must be a string, got 5"),
        (arguments(seed=-1), "seed: must be from 0 to 2**64 - 1"),
    ],
)
def test_what_no_step_could_run_is_refused_naming_the_field(args, message):
    with pytest.raises(InvalidSampling) as e:
        validation.check_sampling(args, VOCAB)
    assert str(e.value).startswith(message), str(e.value)


def test_a_prompt_of_anything_but_the_models_token_ids_is_refused():
    validation.check_prompt([0, 5, VOCAB - 1], VOCAB)
    with pytest.raises(InvalidSampling, match="^prompt: must be one string; it tokenized to list"):
        validation.check_prompt([[1, 2], [3]], VOCAB)
    with pytest.raises(InvalidSampling, match="^prompt: token ids must be from 0 to 1023"):
        validation.check_prompt([3, VOCAB], VOCAB)


def test_what_a_step_can_run_passes_and_a_route_names_its_own_field():
    edges = arguments(top_k=VOCAB - 1, logit_bias={0: -100.0, VOCAB - 1: 5})
    validation.check_sampling(edges, VOCAB)
    validation.check_sampling(arguments(top_k=10**9), None)  # a vocabulary the config does not say
    with pytest.raises(InvalidSampling, match="^stop_sequences: at most"):
        validation.check_sampling(arguments(stop=["x"] * 300), VOCAB, {"stop": "stop_sequences"})


GREEDY = {"temperature": 0.0, "logit_bias": NO_EOS}
# (route, body, what the 400 says); each failed the shared step before, and with it every
# stream of its batch, or (stop sequences) held the generation thread.
HI = [{"role": "user", "content": "Hi"}]
BAD = [
    ("/v1/completions", {"prompt": "Hi", "top_k": 100000, "temperature": 0.5}, "top_k: must be"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"100000": 1}}, "logit_bias: token id"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": 1e400}}, "logit_bias: token 5's"),
    ("/v1/completions", {"prompt": "Hi", "temperature": float("nan")}, "temperature: must be"),
    ("/v1/chat/completions", {"messages": HI, "stop": ["x"] * 300}, "stop: at most"),
    ("/v1/messages", {"messages": HI, "top_k": 100000, "temperature": 0.5}, "top_k: must be"),
    ("/v1/messages", {"messages": HI, "stop_sequences": ["x"] * 300}, "stop_sequences: at most"),
    # A list of strings tokenizes to a list of lists (found by the fuzzer: it failed the
    # prompt cache's lookup, and with it the batch).
    ("/v1/completions", {"prompt": ["Hi", "there"]}, "prompt: must be one string"),
]


def test_a_bad_request_is_refused_alone_while_a_stream_beside_it_goes_on(start):  # noqa: F811
    story = {"prompt": "Tell me a story.", "max_tokens": 200, **GREEDY}
    with start(mlx_lm_server("--plugin", "radix")) as server:
        alone = server.post("/v1/completions", story)["choices"][0]["text"]
        streaming, events = threading.Event(), []

        def good():
            events.extend(server.stream("/v1/completions", story, on_first=streaming.set))

        client = threading.Thread(target=good)
        client.start()
        assert streaming.wait(60)
        answers = []
        for path, body, _ in BAD:
            named = {"model": "claude-test"} if path == "/v1/messages" else {}
            conn, r = server._request("POST", path, {**named, "max_tokens": 8, **body})
            answers.append((r.status, r.read().decode()))
            conn.close()
        client.join(120)
        assert server.get("/health")[0] == 200
    for (status, text), (path, _, message) in zip(answers, BAD):
        assert status == 400 and message in text, (path, status, text)
    assert not any("error" in e for e in events)
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == alone
