"""Tiny random-weight float32 model directories, built offline.

Each directory has config.json, model.safetensors and a byte-level BPE tokenizer
trained here by the ``tokenizers`` library, so ``mlx_lm.load`` and
``mlx_lm.server`` load it like any model from the hub, without the hub.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

VOCAB = 512
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "You are a helpful assistant. Answer the question briefly and politely.",
    "Radix trees share prefixes; pages hold keys and values for attention layers.",
    "Once upon a time there was a small model that learned to count: 1 2 3 4 5 6 7 8 9 10.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Caching the system prompt saves time to first token for every request.",
]

_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
# Default init leaves the residual stream dominated by the current token's embedding and
# the output repeats one token. Larger projections make every token depend on its context,
# so a cache bug shows up as different text.
PROJECTION_SCALE = 3.0

CONFIGS: dict[str, dict] = {
    "llama": dict(_BASE, model_type="llama", num_hidden_layers=2),
    "mistral": dict(_BASE, model_type="mistral", num_hidden_layers=2),
    "qwen2": dict(_BASE, model_type="qwen2", num_hidden_layers=2),
    "qwen3": dict(_BASE, model_type="qwen3", num_hidden_layers=2, head_dim=16),
    "qwen3_moe": dict(
        _BASE,
        model_type="qwen3_moe",
        num_hidden_layers=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    "phi3": dict(_BASE, model_type="phi3", num_hidden_layers=2),  # fused qkv_proj
    # Sliding layers 0 and 2 see 8 tokens; the test prompts are longer than that.
    "gemma3_text": dict(
        _BASE,
        model_type="gemma3_text",
        num_hidden_layers=4,
        head_dim=16,
        num_key_value_heads=1,
        query_pre_attn_scalar=16,
        sliding_window=8,
        sliding_window_pattern=2,
        rope_local_base_freq=10000.0,
    ),
    # Attention sinks, a sliding window of 8 on layer 0, experts.
    "gpt_oss": dict(
        _BASE,
        model_type="gpt_oss",
        num_hidden_layers=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # Sliding layers (window 8) and a full one every fourth.
    "olmo3": dict(_BASE, model_type="olmo3", num_hidden_layers=4, sliding_window=8),
    # Layers 2-3 reuse the K/V of the last earlier layer of their kind (KV sharing); full
    # layers have other head sizes than sliding ones (window 8).
    "gemma4_text": dict(
        _BASE,
        model_type="gemma4_text",
        num_hidden_layers=4,
        head_dim=16,
        global_head_dim=32,
        num_key_value_heads=1,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        sliding_window=8,
        sliding_window_pattern=2,
        use_double_wide_mlp=False,
        tie_word_embeddings=True,
    ),
    # Hybrid models: recurrent layers (an ArraysCache each) between attention layers.
    # Gated delta net layers 0 and 2, full attention layers 1 and 3. Flat, without the
    # multimodal wrapper's text_config: qwen3_5.ModelArgs.from_dict takes a flat config as
    # the text config. mlx-lm's Metal kernel needs key heads of a multiple of 32 dims.
    "qwen3_5": dict(
        _BASE,
        model_type="qwen3_5",
        num_hidden_layers=4,
        head_dim=16,
        full_attention_interval=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
    # Mamba-2, attention, MLP, Mamba-2 (only "M" and "*" layers have a cache). mlx-lm's
    # Metal decode kernel needs a state of a multiple of 32.
    "nemotron_h": dict(
        _BASE,
        model_type="nemotron_h",
        hybrid_override_pattern="M*-M",
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=32,
        conv_kernel=4,
        layer_norm_epsilon=1e-5,
        attention_bias=False,
        mamba_proj_bias=False,
        mlp_bias=False,
        use_bias=False,
        use_conv_bias=True,
    ),
    # Short convolutions (window 3) on layers 0 and 2, full attention on layers 1 and 3.
    "lfm2": dict(
        _BASE,
        model_type="lfm2",
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_ff_dim=128,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        tie_word_embeddings=True,
    ),
    # Every layer a Mamba-2 mixer and attention side by side: a CacheList (ArraysCache,
    # KVCache) a layer.
    "falcon_h1": dict(
        _BASE,
        model_type="falcon_h1",
        num_hidden_layers=2,
        head_dim=16,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_ssm=64,
        mamba_d_state=32,
        mamba_n_groups=1,
        mamba_d_conv=4,
    ),
}
# Models whose cache holds recurrent state besides keys and values.
HYBRID_ARCHS = ("qwen3_5", "nemotron_h", "lfm2", "falcon_h1")
ARCHS = tuple(a for a in CONFIGS if a not in HYBRID_ARCHS)


def build_tokenizer(
    path: Path,
    specials: list[str] = SPECIALS,
    added: list[str] = (),
    chat_template: str = CHAT_TEMPLATE,
    corpus: list[str] = CORPUS,
    vocab: int = VOCAB,
    context: int = 2048,
):
    """A byte-level BPE of ``vocab`` tokens trained on ``corpus``, with ``specials`` and then
    ``added`` (plain tokens: their text is decoded as it is), written with its config to
    ``path``; ``context``: its ``model_max_length``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(added),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    if added:
        tok.add_tokens(list(added))
    assert tok.get_vocab_size(with_added_tokens=True) <= vocab
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                "model_max_length": context,
                "chat_template": chat_template,
            }
        )
    )
    return tok


def build_model(arch: str, path: Path, seed: int = 0, **config_overrides) -> Path:
    """Write a loadable model directory for ``arch`` at ``path``."""
    from mlx_lm.utils import _get_classes

    path.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIGS[arch], eos_token_id=SPECIALS.index("</s>"), torch_dtype="float32")
    config.update(config_overrides)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = {
        k: v * PROJECTION_SCALE if k.endswith("weight") and ("proj" in k or "lm_head" in k) else v
        for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    # mlx-lm's distributed loaders (``sharded_load``, ``--pipeline``) read the index.
    index = {"weight_map": {name: "model.safetensors" for name in weights}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))
    build_tokenizer(path)
    return path


# A llama whose greedy output is scripted: it calls a tool after a user message and
# answers after the tool's result, so tests can drive tool-calling round trips.
TOOL_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# Tokens all distinct (the next token depends on the current one only), spaces included.
TOOL_ANSWER = "Warm, 21 C."
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def tool_call_text(call: dict) -> str:
    """``call`` as the one added token the scripted model emits: compact JSON, and a space
    inside a string escaped (``\\u0020``), since a byte-level detokenizer maps an added
    token's characters one to one and has no character for a space."""
    return json.dumps(call, separators=(",", ":")).replace(" ", "\\u0020")


TOOL_CALL_TEXT = tool_call_text(TOOL_CALL)
# After a tool result the generation prompt ends with <|answer|>, not <|assistant|>.
TOOL_SPECIALS = [*SPECIALS, "<|system|>", "<|tool|>", "<|answer|>"]
# Added like Qwen2.5's (not special): mlx-lm finds the json_tools parser from the
# template, and its state machine switches on their text.
TOOL_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen2.5's template, in CHAT_TEMPLATE's style: tools in the system part, calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, results as <tool_response>.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|system|>' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.'"
    " + '\\n\\nYou are provided with function signatures within <tools></tools> XML tags:'"
    " + '\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name'"
    " + ' and arguments within <tool_call></tool_call> XML tags.</s>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|assistant|>' + (message['content'] or '') }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '</s>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|tool|><tool_response>' + message['content'] + '</tool_response></s>' }}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '</s>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{%- if messages[-1]['role'] == 'tool' %}{{- '<|answer|>' }}"
    "{%- else %}{{- '<|assistant|>' }}{%- endif %}"
    "{%- endif %}"
)
# The logit of a scripted next token; every other logit stays within about +-1.
SCRIPT_LOGIT = 80.0


# The long-context variant's tokenizer: 8,192 tokens trained on mlx-lm's own sources (pinned,
# so the same on every machine). Agent clients send 30-50k characters of English and JSON
# schemas: 16k tokens with it, where the 512-token one needs 35k, and prefill on this CPU grows
# with the square of that.
LONG_VOCAB = 8192
LONG_CONTEXT = 131072


def long_corpus() -> list[str]:
    import mlx_lm

    root = Path(mlx_lm.__file__).parent
    return CORPUS + [f.read_text() for f in sorted(root.rglob("*.py"))]


def build_tool_tokenizer(path: Path, call_text: str = TOOL_CALL_TEXT, long_context: bool = False):
    """The byte-level BPE of ``build_tokenizer`` with the tool tokens and template."""
    added = [*TOOL_ADDED, call_text]
    if not long_context:
        return build_tokenizer(path, TOOL_SPECIALS, added, TOOL_CHAT_TEMPLATE)
    return build_tokenizer(
        path, TOOL_SPECIALS, added, TOOL_CHAT_TEMPLATE, long_corpus(), LONG_VOCAB, LONG_CONTEXT
    )


def build_tool_model(
    path: Path, seed: int = 0, call: dict = TOOL_CALL, long_context: bool = False
) -> Path:
    """Write a llama directory at ``path`` whose greedy output is scripted.

    Attention and MLP outputs are zero, so the last hidden state is the current token's
    embedding and the next token depends on the current token only. ``lm_head`` then
    chains, greedily:

    - ``<|assistant|>`` -> ``<tool_call>`` -> ``call`` (one token) -> ``</tool_call>`` -> ``</s>``
    - ``<|answer|>`` (the prompt after a tool result) -> TOOL_ANSWER's tokens -> ``</s>``

    ``long_context``: a model that reads 131,072 tokens, for agent clients' prompts, with a
    larger tokenizer (``LONG_VOCAB``) and one attention head (its output is zero anyway:
    a quarter of the attention work of four).
    """
    from mlx_lm.utils import _get_classes

    path.mkdir(parents=True, exist_ok=True)
    call_text = tool_call_text(call)
    tok = build_tool_tokenizer(path, call_text, long_context)

    def ids(text: str) -> list[int]:
        return tok.encode(text).ids

    answer = ids(TOOL_ANSWER)
    chain = [
        [ids("<|assistant|>")[0], *ids("<tool_call>"), *ids(call_text)]
        + [*ids("</tool_call>"), tok.token_to_id("</s>")],
        [ids("<|answer|>")[0], *answer, tok.token_to_id("</s>")],
    ]
    assert all(len(ids(t)) == 1 for t in (*TOOL_ADDED, call_text, "<|answer|>"))
    sources = [t for c in chain for t in c[:-1]]
    assert len(set(sources)) == len(sources), "a token would need two next tokens"

    config = dict(CONFIGS["llama"], eos_token_id=SPECIALS.index("</s>"), torch_dtype="float32")
    if long_context:
        config.update(
            vocab_size=LONG_VOCAB,
            max_position_embeddings=LONG_CONTEXT,
            num_attention_heads=1,
            num_key_value_heads=1,
        )
    hidden = config["hidden_size"]
    assert len(sources) <= hidden and tok.token_to_id("</s>") == config["eos_token_id"]
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for k, v in weights.items():
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            weights[k] = mx.zeros_like(v)
    # Each source token's embedding is a basis vector of its own: after the final RMS norm
    # it is sqrt(hidden) along that axis, and lm_head's column there picks the next token.
    embed = weights["model.embed_tokens.weight"]
    head = mx.random.normal(weights["lm_head.weight"].shape) * (0.1 / hidden**0.5)
    basis = mx.eye(hidden)
    for axis, (cur, nxt) in enumerate((c[i], c[i + 1]) for c in chain for i in range(len(c) - 1)):
        embed[cur] = basis[axis]
        head[nxt, axis] = SCRIPT_LOGIT / hidden**0.5
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    index = {"weight_map": {name: "model.safetensors" for name in weights}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))
    return path
