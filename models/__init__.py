"""Models: loading, chat formatting, batch layout, memory-lean logprobs, FSDP2 sharding and checkpoints."""
from models.chat import render_prompt
from models.loading import load_model, load_tokenizer, resolve_model_dir

__all__ = ["load_model", "load_tokenizer", "render_prompt", "resolve_model_dir"]
