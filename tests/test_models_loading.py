"""Model and tokenizer loading: the embedded default (converted once into the user cache), chat formatting,
the atomic conversion cache, attention selection, the tiny test model, and every bad-input message."""
import json
import sys
import threading
import time
import types

import pytest
import torch

from models import load_model, load_tokenizer, render_prompt, resolve_model_dir
from models import loading
from models.loading import resolve_attn_implementation
from tiny import tiny_model

SMOLLM_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_embedded_default_loads_and_generates_text(tokenizer):
    # The first run on a machine converts the GGUF (about 30-40 s); later runs load the cached safetensors.
    model = load_model()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert model.config._attn_implementation == "sdpa"
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    output = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(output[0, len(prompt):], skip_special_tokens=True)
    # Greedy SmolLM2-135M-Instruct answers "The capital of France is Paris."
    assert "Paris" in text, text
    directory = resolve_model_dir(None)
    assert (directory / loading.COMPLETE_MARKER).is_file() and (directory / "model.safetensors").is_file()
    assert not list(directory.parent.glob(f".{directory.name}.*")), "a temporary conversion directory was left behind"


def test_embedded_tokenizer_special_tokens_and_chat_template(tokenizer):
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.pad_token_id == 2  # SmolLM2 pads with its EOS token
    ids = render_prompt(tokenizer, [{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids) == SMOLLM_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with_system = render_prompt(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert tokenizer.decode(with_system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert all(isinstance(token, int) for token in ids)


@pytest.mark.parametrize("messages", [[], "hello", [{"role": "user"}], [{"role": "user", "content": 3}]])
def test_render_prompt_rejects_malformed_messages(tokenizer, messages):
    with pytest.raises(ValueError, match="message"):
        render_prompt(tokenizer, messages)


def test_tokenizer_without_chat_template_is_rejected(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{tmp_path}.*no chat template"):
        load_tokenizer(tmp_path)


def test_a_model_directory_without_a_tokenizer_says_so(tmp_path):
    """On 5cd6fe9 a directory with weights and no tokenizer files was refused as having "no chat template"."""
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path} holds no tokenizer"):
        load_tokenizer(tmp_path)


def test_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model(tmp_path / "does-not-exist")


def test_directory_without_config_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    tiny_model("llama").config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model(tmp_path)


def test_uncached_hub_id_fails_offline_with_directions():
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache.*pass DIR as the model"):
        load_model("nanogrpo-tests/no-such-model")


def test_unreadable_gguf_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOGRPO_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="could not read the GGUF file .*broken.gguf"):
        load_model(broken)
    assert not any((tmp_path / "cache").iterdir()), "a failed conversion left files in the cache"


def test_local_directory_round_trip(tmp_path):
    model = tiny_model("qwen3", tie_word_embeddings=False)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight.float(), model.lm_head.weight.to(torch.bfloat16).float())


def test_attention_auto_choice(monkeypatch):
    assert resolve_attn_implementation("auto", "cpu") == "sdpa"
    assert resolve_attn_implementation("eager", "cpu") == "eager"
    monkeypatch.setattr("models.loading.importlib.util.find_spec", lambda name: object() if name == "flash_attn" else None)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=None))  # imports
    assert resolve_attn_implementation("auto", "cuda", "bfloat16") == "flash_attention_2"
    assert resolve_attn_implementation("auto", "cuda") == "sdpa"  # fp32 compute: flash-attn refuses it
    assert resolve_attn_implementation("auto", "cpu") == "sdpa"


def test_concurrent_conversions_leave_one_complete_directory(tmp_path, monkeypatch):
    """Two converters racing on the same GGUF: both get the same complete directory, no temporaries left."""
    monkeypatch.setenv("NANOGRPO_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "fake.gguf"
    source.write_bytes(b"x" * 10)
    calls = []

    def slow_fake_conversion(gguf_path, out_dir):
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        time.sleep(0.3)  # both threads are inside the conversion at once
        (out_dir / loading.COMPLETE_MARKER).write_text(json.dumps({"thread": threading.get_ident()}))

    monkeypatch.setattr(loading, "_write_conversion", slow_fake_conversion)
    results = []
    threads = [threading.Thread(target=lambda: results.append(loading.convert_gguf(source))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 2 and results[0] == results[1]
    assert (results[0] / loading.COMPLETE_MARKER).is_file()
    assert sorted(path.name for path in (tmp_path / "cache").iterdir()) == [results[0].name]
    # A finished conversion is reused without converting again.
    assert loading.convert_gguf(source) == results[0] and len(calls) == 2


def test_cache_location_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("NANOGRPO_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert loading.cache_root() == tmp_path / "nanogrpo"
    monkeypatch.setenv("NANOGRPO_CACHE", str(tmp_path / "elsewhere"))
    assert loading.cache_root() == tmp_path / "elsewhere"


def test_tiny_model_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first, second, other = tiny_model("llama", seed=4), tiny_model("llama", seed=4), tiny_model("llama", seed=5)
    assert torch.rand(1) == expected_next
    assert torch.equal(first.model.embed_tokens.weight, second.model.embed_tokens.weight)
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert first.config.hidden_size == 64 and first.config.num_hidden_layers == 2 and first.config.vocab_size == 49152
    assert tiny_model("qwen3", tie_word_embeddings=False).lm_head.weight is not None
    with pytest.raises(ValueError, match="arch"):
        tiny_model("gpt2")
