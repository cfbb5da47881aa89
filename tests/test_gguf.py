"""The GGUF converter on tiny llamas written as GGUF the way llama.cpp writes them."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny_models import CONFIGS, PROJECTION_SCALE

from mlx_radix_plugin.models import gguf
from mlx_radix_plugin.models.gguf import GGUFError, convert, dense_weights, mlx_name

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"

# llama.cpp's names, written out here rather than taken from the module under test.
GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def to_gguf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base in GGUF_NAMES:
        return f"{GGUF_NAMES[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` of llama.cpp's convert_hf_to_gguf.py."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tiny_vocab() -> list[str]:
    from tokenizers import pre_tokenizers

    return CONTROL + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]


def tiny_llama(tied: bool):
    from mlx_lm.utils import _get_classes

    config = dict(CONFIGS["llama"], vocab_size=len(tiny_vocab()), tie_word_embeddings=tied)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.load_weights(
        [(k, v * PROJECTION_SCALE) for k, v in tree_flatten(model.parameters()) if "proj" in k],
        strict=False,
    )
    return model, config


def write_gguf(model, config, path, **metadata_overrides):
    """Write ``model`` as llama.cpp does: its names, Q/K rows permuted, its metadata keys."""
    u32 = lambda x: mx.array(x, dtype=mx.uint32)  # noqa: E731
    tensors = {}
    for name, w in tree_flatten(model.parameters()):
        w = np.array(w)
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, config["num_key_value_heads"])
        tensors[to_gguf_name(name)] = mx.array(w)
    vocab = tiny_vocab()
    metadata = {
        "general.architecture": "llama",
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(config["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        "llama.context_length": u32(config["max_position_embeddings"]),
        "llama.vocab_size": u32(len(vocab)),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": vocab,
        "tokenizer.ggml.token_type": mx.array(
            [3 if t in CONTROL else 1 for t in vocab], dtype=mx.int32
        ),
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.unknown_token_id": u32(0),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    metadata.update(metadata_overrides)
    mx.save_gguf(str(path), tensors, metadata)
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "lm_head"])
def converted(request, tmp_path_factory):
    """(original model, its config, converted directory)."""
    model, config = tiny_llama(tied=request.param)
    root = tmp_path_factory.mktemp("gguf")
    out = convert(write_gguf(model, config, root / "tiny.gguf"), root / "model", dtype="float32")
    return model, config, out


@pytest.mark.parametrize(
    "gguf_name, expected",
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.12.ffn_norm.weight", "model.layers.12.post_attention_layernorm.weight"),
        ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight"),
        ("blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight"),
        ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.29.ffn_gate.weight", "model.layers.29.mlp.gate_proj.weight"),
        ("blk.29.ffn_up.weight", "model.layers.29.mlp.up_proj.weight"),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
    ],
)
def test_tensor_names_map_to_mlx_lm_llama(gguf_name, expected):
    assert mlx_name(gguf_name) == expected


def test_unknown_tensor_is_refused_by_name():
    with pytest.raises(GGUFError, match=r"'rope_freqs\.weight'.*accepted"):
        mlx_name("rope_freqs.weight")


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(2 * 16 * 3, dtype=np.float32).reshape(2 * 16, 3)
    permuted = llama_cpp_permute(w, n_head=2)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(np.array(gguf.unpermute_rows(mx.array(permuted), 2)), w)


def test_converted_model_has_the_original_logits(converted):
    from mlx_lm import load

    original, config, path = converted
    model, _ = load(str(path))
    prompt = mx.array([[5, 77, 140, 3, 200, 9, 31, 250, 4, 100, 60, 12]])
    expected = original(prompt)
    np.testing.assert_allclose(np.array(model(prompt)), np.array(expected), rtol=1e-5, atol=1e-5)

    # The check has teeth: the same model with the GGUF's permuted Q/K rows answers otherwise.
    permuted = {
        k: mx.array(llama_cpp_permute(np.array(v), config[heads]))
        for k, v in tree_flatten(original.parameters())
        for proj, heads in (("q_proj", "num_attention_heads"), ("k_proj", "num_key_value_heads"))
        if k.endswith(f"{proj}.weight")
    }
    model.load_weights(list(permuted.items()), strict=False)
    assert not np.allclose(np.array(model(prompt)), np.array(expected), atol=1e-3)


def test_metadata_becomes_config_json(converted):
    _, config, path = converted
    written = json.loads((path / "config.json").read_text())
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert written[key] == config[key], key
    assert written["model_type"] == "llama"
    assert written["head_dim"] == config["hidden_size"] // config["num_attention_heads"]
    assert written["rms_norm_eps"] == 1e-5  # not float32's 9.999999747378752e-06
    assert written["rope_theta"] == config["rope_theta"]
    assert written["rope_traditional"] is False
    assert (written["bos_token_id"], written["eos_token_id"]) == (1, 2)
    assert written["torch_dtype"] == "float32"
    weights = mx.load(str(path / "model.safetensors"))
    assert ("lm_head.weight" in weights) is not config["tie_word_embeddings"]
    assert {v.dtype for v in weights.values()} == {mx.float32}


def test_tokenizer_from_gguf_vocab(converted):
    from mlx_lm.tokenizer_utils import load

    _, _, path = converted
    tok = load(path)
    vocab = tiny_vocab()
    ids = tok.encode("<|im_start|>the 42<|im_end|>")
    # Merges apply ("Ġthe"), digits split one by one, control tokens stay whole.
    assert [vocab[i] for i in ids] == ["<|im_start|>", "t", "he", "Ġ", "4", "2", "<|im_end|>"]
    assert [vocab[i] for i in tok.encode(" the")] == ["Ġthe"]
    assert tok.decode(ids, skip_special_tokens=True) == "the 42"
    assert (tok.bos_token, tok.eos_token, tok.eos_token_ids) == ("<|im_start|>", "<|im_end|>", {2})
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>hi<|im_end|>"


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_tensors_are_dequantized_and_unpermuted(bits):
    x = mx.random.normal((32, 64), key=mx.random.key(bits))
    w, scales, biases = mx.quantize(x, group_size=32, bits=bits)
    tensors = {"blk.0.attn_k.weight": w, "blk.0.attn_k.scales": scales}
    tensors["blk.0.attn_k.biases"] = biases
    out = dense_weights(tensors, {"num_key_value_heads": 2}, "float32")
    dense = mx.dequantize(w, scales, biases, group_size=32, bits=bits)
    expected = gguf.unpermute_rows(dense, 2)
    assert list(out) == ["model.layers.0.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(np.array(out["model.layers.0.self_attn.k_proj.weight"]), expected)
    assert float(mx.abs(expected - gguf.unpermute_rows(x, 2)).max()) < 0.5  # it is x, quantized


def test_other_architectures_are_refused(tmp_path):
    model, config = tiny_llama(tied=True)
    path = write_gguf(model, config, tmp_path / "x.gguf", **{"general.architecture": "qwen2"})
    with pytest.raises(GGUFError, match=r"architecture 'qwen2'.*accepted: 'llama'"):
        convert(path, tmp_path / "out", dtype="float32")
    assert not (tmp_path / "out").exists()


def test_bad_dtype_and_unreadable_file_are_named(tmp_path):
    with pytest.raises(GGUFError, match=r"dtype 'int8'.*float32"):
        convert(tmp_path / "missing.gguf", tmp_path / "out", dtype="int8")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(GGUFError, match=r"junk\.gguf"):
        convert(tmp_path / "junk.gguf", tmp_path / "out", dtype="float32")


def test_default_dtype_follows_the_device(monkeypatch):
    monkeypatch.setattr(gguf.mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(gguf.mx, "is_available", lambda device: True)
    assert gguf.default_dtype() == "float16"
    monkeypatch.setattr(gguf.mx, "default_device", lambda: mx.Device(mx.cpu))
    assert gguf.default_dtype() == "float32"

    def broken():
        raise RuntimeError("no backend")

    monkeypatch.setattr(gguf.mx, "default_device", broken)
    assert gguf.default_dtype() == "float32"
