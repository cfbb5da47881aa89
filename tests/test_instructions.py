"""System messages after the first: rendered in place where the template can, folded into the
user turn next to them where it cannot, and either way a turn stays a prefix of the next."""

import hypothesis.strategies as st
import pytest
from hypothesis import given
from tiny_models import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE, TOOL_SPECIALS, build_tokenizer

from mlx_radix_plugin.agents import instructions

# Gemma's and Mistral's templates refuse roles out of turn.
RAISING = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# Some templates render the first system message and skip the others.
DROPPING = (
    "{% for m in messages %}"
    "{% if m['role'] != 'system' or loop.first %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def load(tmp_path, template: str):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    build_tokenizer(tmp_path, TOOL_SPECIALS, chat_template=template)
    return load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    "template, in_place",
    [(CHAT_TEMPLATE, True), (TOOL_CHAT_TEMPLATE, True), (RAISING, False), (DROPPING, False)],
    ids=["generic", "qwen-like", "raising", "dropping"],
)
def test_each_template_is_asked_once_whether_it_renders_system_messages_in_place(
    tmp_path, template, in_place
):
    tokenizer = load(tmp_path, template)
    calls = []
    render = tokenizer.apply_chat_template

    def counted(*args, **kwargs):
        calls.append(1)
        return render(*args, **kwargs)

    tokenizer.apply_chat_template = counted
    assert instructions.renders_in_place(tokenizer, {}) is in_place
    asked = len(calls)
    assert instructions.renders_in_place(tokenizer, {}) is in_place
    assert len(calls) == asked

    # Claude Code's first turn: its environment as a system message after the user's.
    messages = [
        {"role": "system", "content": "Be an agent."},
        {"role": "user", "content": "What is in notes.txt?"},
        {"role": "system", "content": "cwd: /tmp/work"},
    ]
    placed = instructions.place(messages, tokenizer, {})
    text = render(placed, add_generation_prompt=True, tokenize=False)
    assert "cwd: /tmp/work" in text and "What is in notes.txt?" in text
    assert placed == messages if in_place else placed[1]["role"] == "user"


def test_folding_joins_instructions_to_the_user_turn_beside_them():
    messages = [
        {"role": "system", "content": "A"},
        {"role": "system", "content": "B"},
        {"role": "user", "content": "u1"},
        {"role": "system", "content": "env"},
        {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "note"},
        {"role": "user", "content": "u2"},
        {"role": "tool", "tool_call_id": "c", "content": "r"},
        {"role": "system", "content": "late"},
    ]
    assert instructions.fold(messages) == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "u1\n\nenv"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "note\n\nu2"},
        {"role": "tool", "tool_call_id": "c", "content": "r"},
        {"role": "user", "content": "late"},
    ]


MESSAGE = st.builds(
    lambda role, text: {"role": role, "content": text},
    st.sampled_from(["system", "user", "assistant", "tool"]),
    st.text("abc", min_size=1, max_size=3),
)


@given(st.lists(MESSAGE, max_size=12), st.lists(MESSAGE, max_size=6))
def test_a_folded_turn_is_the_start_of_the_next_one(turn, appended):
    """What a client appends never changes how the turn before it folded, except that its
    last message may go on (the generation prompt after it was never cached anyway)."""
    before, after = instructions.fold(turn), instructions.fold(turn + appended)
    assert after[: max(len(before) - 1, 0)] == before[:-1]
    if before:
        last, same = before[-1], after[len(before) - 1]
        assert same["role"] == last["role"] and same["content"].startswith(last["content"])
    roles = [m["role"] for m in after]
    assert "system" not in roles[1:]
    assert not any(a == b == "user" for a, b in zip(roles, roles[1:]))
