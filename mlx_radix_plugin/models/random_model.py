"""Random-weight model directories of real shapes, built offline, for benchmarks.

The tokenizer is a byte-level BPE, the kind Llama-3, Qwen and SmolLM2 ship, so mlx-lm
streams its output through the same detokenizer as theirs (``BPEStreamingDetokenizer``; a
word-level one gets ``NaiveStreamingDetokenizer``, which decodes the whole line again at
every token). Ids 0 and 1 are ``<eos>`` and ``<unk>``, then the 256 byte symbols, then
every id from ``FIRST_WORD`` on is one lowercase word after a space (all 1-letter words,
then 2-letter, ... up to the vocabulary's size), so ``words(ids)`` is exactly ``ids``
again. The weights give EOS a logit of 0 (its output row is zero), which never tops the
random logits of a real vocabulary: greedy outputs run to full length with no logit bias,
as real clients send none.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

# Llama 3's layers and its RoPE scaling (Llama 3.1 and 3.2 scale by a factor of their own).
LLAMA_3_8B = dict(
    model_type="llama",
    hidden_size=4096,
    num_hidden_layers=32,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
LLAMA_3_ROPE = dict(
    rope_type="llama3",
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=30,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        max_position_embeddings=8192,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA_3_ROPE, factor=32.0),
        max_position_embeddings=131072,
    ),
    "llama-3-8b": LLAMA_3_8B,
    # Llama-3.1-8B: Llama-3-8B's layers with RoPE scaled to 131,072 tokens, for the long
    # contexts agents send.
    "llama-3.1-8b": dict(
        LLAMA_3_8B,
        rope_scaling=dict(LLAMA_3_ROPE, factor=8.0),
        max_position_embeddings=131072,
    ),
    # Qwen3-1.7B's layers (its published config): per-head norms of q and k, heads of 128
    # over a hidden size of 2,048; a small model where a decode step is host work, for
    # decode.compile's Qwen path on a GPU.
    "qwen3-1.7b": dict(
        model_type="qwen3",
        hidden_size=2048,
        num_hidden_layers=28,
        intermediate_size=6144,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
    ),
    # Qwen3.5-0.8B's layers (its published config): 18 gated delta net layers and full
    # attention every 4th, 2 KV heads of 256. The vocabulary is SmolLM2's: the real 248,320
    # makes a prefill's logits cost more than its 24 layers on 2 CPU cores.
    "qwen3.5-0.8b": dict(
        model_type="qwen3_5",
        hidden_size=1024,
        num_hidden_layers=24,
        intermediate_size=3584,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rope_parameters={"type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=262144,
    ),
}
# SmolLM2-135M's layout at a size MLX's CPU backend runs in milliseconds: for tests and
# smoke runs of the benchmarks (``build("smollm2-135m", path, **TINY)``).
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=600,
)
# The same, reading 131,072 tokens: agent sessions at their clients' scale (24k-token system
# prompts) on a CPU, where prefill on SmolLM2-135M's shape would take minutes a request.
SHAPES["tiny-long"] = dict(SHAPES["smollm2-135m"], **TINY, max_position_embeddings=131072)
EOS, UNK = 0, 1
SPECIAL = {"<eos>": EOS, "<unk>": UNK}
FIRST_WORD = len(SPECIAL) + 256  # the first id that is a word (after the byte symbols)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _word(index: int) -> str:
    """The ``index``-th word: the 26 one-letter words, then the 676 two-letter ones, ..."""
    length = 1
    while index >= len(LETTERS) ** length:
        index -= len(LETTERS) ** length
        length += 1
    letters = []
    for _ in range(length):
        index, r = divmod(index, len(LETTERS))
        letters.append(LETTERS[r])
    return "".join(reversed(letters))


def words(ids) -> str:
    """The text whose tokens are ``ids`` (each at least ``FIRST_WORD``)."""
    return "".join(" " + _word(i - FIRST_WORD) for i in ids)


def _byte_level_bpe(vocab_size: int):
    """The byte-level BPE of the module's docstring: a word's token is merged letter by
    letter from the space's byte symbol, so every shorter word is a token too."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    symbols = pre_tokenizers.ByteLevel.alphabet()
    space = next(c for c in symbols if ord(c) == 0x120)  # GPT-2's symbol for " "
    alphabet = sorted(symbols, key=lambda c: (c != space, c))
    vocab = {**SPECIAL, **{c: len(SPECIAL) + i for i, c in enumerate(alphabet)}}
    merges = []
    for i in range(vocab_size - FIRST_WORD):
        word = _word(i)
        vocab[space + word] = FIRST_WORD + i
        merges.append((space + word[:-1], word[-1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    return tok


def build(shape: str, path: Path, dtype: str = "float32", seed: int = 0, **overrides) -> Path:
    """Write a loadable model directory of ``shape`` (config keys overridable)."""
    from mlx_lm.utils import _get_classes

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if vocab := overrides.get("vocab_size"):
        if vocab <= FIRST_WORD:
            raise ValueError(f"vocab_size {vocab}: it must be above {FIRST_WORD} (byte symbols)")
    config = {
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        **SHAPES[shape],
        **overrides,
        "rms_norm_eps": 1e-5,
        "eos_token_id": EOS,
        "torch_dtype": dtype,
    }
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    cast = tree_map(lambda p: p.astype(getattr(mx, dtype)), model.parameters())
    weights = dict(tree_flatten(cast))
    # EOS's output row is zero: its logit is 0, below the largest of the random others.
    heads = [k for k in weights if k.endswith("lm_head.weight")]
    heads = heads or [k for k in weights if k.endswith("embed_tokens.weight")]
    weights[heads[0]][EOS] = 0
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))

    tok = _byte_level_bpe(config["vocab_size"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<eos>",
                "unk_token": "<unk>",
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
            }
        )
    )
    return path
