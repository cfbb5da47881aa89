"""GGUF -> mlx-lm model directory: dense weights, ``config.json`` and a ``tokenizers`` tokenizer.

Covers what a llama-architecture GGUF with a GPT-2 style byte-level BPE vocabulary needs
(SmolLM2, the default model): ``mx.load`` reads the file, quantized tensors are dequantized to
one dense dtype, llama.cpp's tensor names become mlx-lm's, and llama.cpp's Q/K row permutation
is undone so mlx-lm's non-traditional RoPE applies. Anything else is refused with a
:class:`GGUFError` that names what was found and what is accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

# Every GGUF block quantization MLX maps to its affine format (Q4_0, Q4_1, Q8_0) has 32
# weights per block.
GGUF_GROUP_SIZE = 32
DTYPES = ("float32", "float16", "bfloat16")

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)")

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# llama.cpp's pre-tokenizer name -> whether digits are split one by one before the GPT-2 pattern
# (llama.cpp: LLAMA_VOCAB_PRE_TYPE_SMOLLM runs "\p{N}" and then the GPT-2 regex).
_PRE_TOKENIZERS = {"smollm": True, "gpt-2": False}


class GGUFError(ValueError):
    """A GGUF file this converter cannot turn into an mlx-lm model; the message says why."""


def default_dtype() -> str:
    """float16 where MLX computes on a GPU (Metal, CUDA), else float32.

    MLX's CPU backend runs float16 10-40x slower than float32, a GPU the other way round.
    """
    try:
        on_gpu = mx.default_device().type == mx.gpu and mx.is_available(mx.gpu)
    except (AttributeError, RuntimeError, ValueError):
        # An MLX without these queries, or one that cannot answer: CPU is always correct.
        on_gpu = False
    return "float16" if on_gpu else "float32"


def mlx_name(gguf_name: str) -> str:
    """mlx-lm's llama parameter name for a llama.cpp tensor name (``.weight`` kept)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{suffix}"
    m = _LAYER_NAME.fullmatch(base)
    if m and m.group(2) in _PER_LAYER:
        return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{suffix}"
    raise GGUFError(
        f"tensor {gguf_name!r} has no mlx-lm llama counterpart; accepted: "
        f"{', '.join(_TOP_LEVEL)} and blk.N.{{{', '.join(_PER_LAYER)}}}"
    )


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py``'s ``permute``).

    llama.cpp's RoPE rotates adjacent pairs (GPT-J style), so its converter interleaves each
    head's two rotary halves: row ``h, 2i + j`` of the GGUF is row ``h, j*half + i`` of the
    original. mlx-lm's ``rope_traditional: false`` rotates the halves, so the rows go back.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_REQUIRED = object()


def _meta(metadata: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    if key not in metadata:
        if default is _REQUIRED:
            raise GGUFError(f"GGUF metadata lacks {key!r}")
        return default
    value = metadata[key]
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _float32(x: float) -> float:
    # GGUF stores float32: 1e-05 reads back as 9.999999747378752e-06; keep the short form.
    return float(str(np.float32(x)))


def read_config(metadata: Mapping[str, Any], weights: Mapping[str, mx.array]) -> dict:
    """mlx-lm's ``config.json`` for a llama GGUF's metadata."""
    arch = _meta(metadata, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; accepted: 'llama'")
    scaling = _meta(metadata, "llama.rope.scaling.type", "none")
    if scaling != "none":
        raise GGUFError(f"RoPE scaling {scaling!r} is not supported; accepted: 'none'")
    heads = int(_meta(metadata, "llama.attention.head_count"))
    hidden = int(_meta(metadata, "llama.embedding_length"))
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_meta(metadata, "llama.block_count")),
        "intermediate_size": int(_meta(metadata, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(metadata, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_meta(metadata, "llama.attention.key_length", hidden // heads)),
        "rms_norm_eps": _float32(_meta(metadata, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(_meta(metadata, "llama.rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "max_position_embeddings": int(_meta(metadata, "llama.context_length")),
        "vocab_size": int(
            _meta(metadata, "llama.vocab_size", len(_meta(metadata, "tokenizer.ggml.tokens")))
        ),
        "tie_word_embeddings": "output.weight" not in weights,
    }
    for key in ("bos", "eos"):
        if f"tokenizer.ggml.{key}_token_id" in metadata:
            config[f"{key}_token_id"] = int(_meta(metadata, f"tokenizer.ggml.{key}_token_id"))
    return config


def dense_weights(weights: Mapping[str, mx.array], config: dict, dtype: str) -> dict[str, mx.array]:
    """mlx-lm llama weights in ``dtype`` from the tensors ``mx.load`` read from a GGUF."""
    out = {}
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name.removesuffix(".weight")
        if f"{base}.scales" in weights:
            scales = weights[f"{base}.scales"]
            in_features = scales.shape[-1] * GGUF_GROUP_SIZE
            bits = w.shape[-1] * 32 // in_features  # uint32 words hold 32 // bits weights
            w = mx.dequantize(
                w, scales, weights[f"{base}.biases"], group_size=GGUF_GROUP_SIZE, bits=bits
            )
        # Rows are independent, so undoing the permutation after dequantizing is the same as
        # permuting the packed rows together with their scales and biases.
        if base.endswith(".attn_q"):
            w = unpermute_rows(w, config["num_attention_heads"])
        elif base.endswith(".attn_k"):
            w = unpermute_rows(w, config["num_key_value_heads"])
        out[mlx_name(name)] = w.astype(getattr(mx, dtype))
    return out


def build_tokenizer(metadata: Mapping[str, Any]):
    """A ``tokenizers.Tokenizer`` and its ``tokenizer_config.json`` from a GGUF's vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _meta(metadata, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"tokenizer model {kind!r} is not supported; accepted: 'gpt2'")
    pre = _meta(metadata, "tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(
            f"pre-tokenizer {pre!r} is not supported; accepted: {', '.join(_PRE_TOKENIZERS)}"
        )
    tokens = list(_meta(metadata, "tokenizer.ggml.tokens"))
    types = np.array(_meta(metadata, "tokenizer.ggml.token_type", [1] * len(tokens)))
    # Byte-level BPE spells a space as "Ġ", so a merge's two halves are split by its one space.
    merges = [tuple(m.split(" ")) for m in _meta(metadata, "tokenizer.ggml.merges")]

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _PRE_TOKENIZERS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match whole and never be split by BPE.
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=bool(types[i] == _CONTROL), normalized=False)
            for i in np.flatnonzero((types == _CONTROL) | (types == _USER_DEFINED))
        ]
    )

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_meta(metadata, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_meta(metadata, "llama.context_length", 2048)),
    }
    for key, name in (("bos", "bos"), ("eos", "eos"), ("unknown", "unk"), ("padding", "pad")):
        if f"tokenizer.ggml.{key}_token_id" in metadata:
            i = int(_meta(metadata, f"tokenizer.ggml.{key}_token_id"))
            tokenizer_config[f"{name}_token"] = tokens[i]
    if "tokenizer.chat_template" in metadata:
        tokenizer_config["chat_template"] = _meta(metadata, "tokenizer.chat_template")
    return tok, tokenizer_config


def convert(gguf_path: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Write an mlx-lm model directory for ``gguf_path`` to ``out_dir``; returns ``out_dir``.

    ``dtype`` is the dense dtype of every weight; ``None`` picks :func:`default_dtype`.
    """
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        weights, metadata = mx.load(str(gguf_path), return_metadata=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise GGUFError(f"cannot read {gguf_path} as GGUF: {e}") from e
    config = read_config(metadata, weights)
    config["torch_dtype"] = dtype
    tokenizer, tokenizer_config = build_tokenizer(metadata)
    dense = dense_weights(weights, config, dtype)

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), dense, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out_dir
