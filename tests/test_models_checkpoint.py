"""Checkpoints on one process: HF export that transformers reloads, exact resume, atomic saves (a save killed
midway leaves the previous checkpoint as the latest), and damaged checkpoints that refuse to half-load."""
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from models import fsdp, load_tokenizer
from models.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from models.logprobs import completion_logprobs, pad_batch
from tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 4096  # a small vocabulary keeps each AdamW step cheap; the layout is the same as at 49,152


def new_run(seed: int = 0):
    model = tiny_model("qwen3", tie_word_embeddings=False, seed=seed, vocab_size=VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return model, optimizer


def train_step(model, optimizer, generator: torch.Generator) -> float:
    """One step whose data comes from `generator` and whose noise comes from the global RNGs."""
    prompts = [torch.randint(3, VOCAB, (4,), generator=generator).tolist() for _ in range(2)]
    completions = [torch.randint(3, VOCAB, (3,), generator=generator).tolist() for _ in range(2)]
    batch = pad_batch(prompts, completions, pad_id=2)
    logprobs, _ = completion_logprobs(model, batch)
    noise = torch.rand(()) + random.random() + float(np.random.rand())
    loss = -(logprobs * batch["completion_mask"]).sum() / batch["completion_mask"].sum() + 1e-3 * noise
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def seed_everything():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def test_resume_continues_exactly(tmp_path):
    seed_everything()
    model, optimizer = new_run()
    generator = torch.Generator().manual_seed(5)
    uninterrupted = [train_step(model, optimizer, generator) for _ in range(4)]

    seed_everything()
    model, optimizer = new_run()
    generator = torch.Generator().manual_seed(5)
    resumed = [train_step(model, optimizer, generator) for _ in range(2)]
    save_checkpoint(tmp_path / "checkpoints" / "step_2", model, None, optimizer, 2, extra={"position": 4})
    data_state = generator.get_state()  # the data's position is the trainer's to keep (in `extra`, as a sampler's)
    # A fresh process: different weights, optimizer and global RNG states until the checkpoint is loaded.
    model, optimizer = new_run(seed=9)
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    step, extra = load_checkpoint(latest_checkpoint(tmp_path), model, optimizer)
    assert (step, extra) == (2, {"position": 4})
    generator = torch.Generator()
    generator.set_state(data_state)
    resumed += [train_step(model, optimizer, generator) for _ in range(2)]
    assert resumed == uninterrupted  # bit for bit


def test_export_loads_in_plain_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, optimizer = new_run()
    tokenizer = load_tokenizer()
    directory = save_checkpoint(tmp_path / "step_3", model, tokenizer, optimizer, 3)
    exported = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    probe = torch.tensor([[1, 400, 900, 33, 2]])
    with torch.no_grad():
        assert torch.equal(exported(input_ids=probe).logits, model(input_ids=probe).logits)
    assert exported.config.architectures == ["Qwen3ForCausalLM"]
    reloaded_tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    messages = [{"role": "user", "content": "Hi"}]
    assert reloaded_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # Tied embeddings are written once, as HF does; names are plain HF names.
    tied = tiny_model("llama", tie_word_embeddings=True)
    names = [name for name, _ in fsdp.full_state_dict(tied)]
    assert "lm_head.weight" not in names and names[0] == "model.embed_tokens.weight"
    assert set(names) == set(tied.state_dict()) - {"lm_head.weight"}


def test_latest_checkpoint_skips_partial_and_hidden_directories(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    model, _ = new_run()
    save_checkpoint(tmp_path / "step_2", model, None, None, 2)
    save_checkpoint(tmp_path / "step_10", model, None, None, 10)
    (tmp_path / "step_11").mkdir()  # a directory without a completion marker
    (tmp_path / ".step_12.partial").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"  # numeric order, not string order
    with pytest.raises(ValueError, match="partial or interrupted"):
        load_checkpoint(tmp_path / "step_11", model)


def test_save_killed_midway_keeps_previous_checkpoint(tmp_path):
    model, _ = new_run()
    save_checkpoint(tmp_path / "checkpoints" / "step_1", model, None, None, 1)
    script = (
        "import sys; from tests.faults import pause_in_save; from tests.tiny import tiny_model;"
        "from models.checkpoint import save_checkpoint; pause_in_save(60);"
        f"save_checkpoint(sys.argv[1], tiny_model('qwen3', tie_word_embeddings=False, vocab_size={VOCAB}), None, None, 2)"
    )
    target = tmp_path / "checkpoints" / "step_2"
    child = subprocess.Popen([sys.executable, "-c", script, str(target)], cwd=ROOT)
    partial = tmp_path / "checkpoints" / ".step_2.partial"
    deadline = time.time() + 60
    while not (partial / "rng").is_dir() and time.time() < deadline:  # weights written, now sleeping
        time.sleep(0.1)
    child.kill()
    child.wait()
    assert (partial / "model.safetensors").is_file(), "the child never reached the pause"
    assert not target.exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_1"
    with pytest.raises(ValueError, match="partial or interrupted"):
        load_checkpoint(partial, model)
    # The next save of the same step clears the leftover and completes.
    save_checkpoint(target, model, None, None, 2)
    assert latest_checkpoint(tmp_path) == target and not partial.exists()


@pytest.fixture
def saved(tmp_path):
    model, optimizer = new_run()
    train_step(model, optimizer, torch.Generator().manual_seed(1))
    return save_checkpoint(tmp_path / "step_1", model, None, optimizer, 1)


def test_missing_file_is_detected(saved):
    (saved / "optimizer" / ".metadata").unlink()
    model, optimizer = new_run(seed=3)
    with pytest.raises(FileNotFoundError, match="optimizer/.metadata is missing"):
        load_checkpoint(saved, model, optimizer)


def test_truncated_weights_are_detected_before_loading(saved):
    path = saved / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    model, optimizer = new_run(seed=3)
    before = model.lm_head.weight.clone()
    with pytest.raises(ValueError, match="model.safetensors has .* bytes.*damaged"):
        load_checkpoint(saved, model, optimizer)
    assert torch.equal(model.lm_head.weight, before) and not optimizer.state


def test_wrong_shapes_never_half_load(saved):
    model = tiny_model("qwen3", tie_word_embeddings=False, vocab_size=1000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # a fresh optimizer has no state yet
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"wrong shapes.*model.embed_tokens.weight \(4096, 64\) \(model \(1000, 64\)\)"):
        load_checkpoint(saved, model, optimizer)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert not optimizer.state


def test_weights_only_checkpoint_refuses_an_optimizer(tmp_path):
    model, optimizer = new_run()
    directory = save_checkpoint(tmp_path / "step_5", model, None, None, 5, extra={"note": "weights only"})
    with pytest.raises(ValueError, match="without optimizer state"):
        load_checkpoint(directory, model, optimizer)
    assert load_checkpoint(directory, model) == (5, {"note": "weights only"})
    marker = json.loads((directory / "COMPLETE").read_text())
    assert marker["step"] == 5 and "model.safetensors" in marker["files"]
