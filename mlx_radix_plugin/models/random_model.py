"""Random-weight model directories of real shapes, built offline, for benchmarks.

The tokenizer is a word-level one with one word per token id (``t2`` ... ``tN``; ids 0
and 1 are ``<eos>`` and ``<unk>``), so a prompt of N words is exactly N tokens and
every id the model emits decodes. Where transformers gives a model type a tokenizer class
of its own, which puts its own byte-level splitting in front of any vocabulary (Qwen3.5's),
it is a byte-level BPE of three-letter words instead: a word after a space is one token.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

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
    ),
    "llama-3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
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
    ),
}
# Model types whose tokenizer class in transformers splits text its own byte-level way.
BYTE_LEVEL_TOKENIZERS = {"qwen3_5"}
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
EOS, UNK = 0, 1
SPECIAL = {"<eos>": EOS, "<unk>": UNK}


def words(ids) -> str:
    """The text whose tokens are ``ids`` (each >= 2)."""
    return " ".join(f"t{i}" for i in ids)


def _byte_level_words(vocab_size: int):
    """A byte-level BPE whose merges make each three-letter word after a space one token."""
    import itertools
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    letters = string.ascii_lowercase
    words = ["".join(w) for w in itertools.product(letters, repeat=3)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 8192),
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        [" ".join(words[i : i + 64]) for i in range(0, len(words), 64)], trainer
    )
    return tok


def build(shape: str, path: Path, dtype: str = "float32", seed: int = 0, **overrides) -> Path:
    """Write a loadable model directory of ``shape`` (config keys overridable)."""
    from mlx_lm.utils import _get_classes
    from tokenizers import Tokenizer, models, pre_tokenizers

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(
        SHAPES[shape],
        **overrides,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        eos_token_id=EOS,
        torch_dtype=dtype,
    )
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p.astype(getattr(mx, dtype)), model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))

    if config["model_type"] in BYTE_LEVEL_TOKENIZERS:
        tok = _byte_level_words(config["vocab_size"])
    else:
        vocab = {**SPECIAL, **{f"t{i}": i for i in range(2, config["vocab_size"])}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
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
