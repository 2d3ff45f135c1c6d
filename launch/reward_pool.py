"""The run's reward functions, built once from the `reward` section (`reward_functions`), with the model a triple
extractor needs (rewards know no model), and the optional workers (reward.num_workers) that score a step's
completions concurrently, started by a fork server without torch (forking the training process is not safe)."""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import rewards
from rewards.factqa import INDEX_ENV, make_factqa_reward
from rewards.triples import ModelTripleExtractor

if TYPE_CHECKING:  # a worker imports this module: it stays free of torch (grpo.config imports it)
    from grpo.config import RewardConfig

START_TIMEOUT_S = 300.0  # a worker imports the rewards (and, for a model triple extractor, loads an LM)


class RewardWorkerError(RuntimeError):
    """A reward worker died, or a reward raised inside one (its traceback is attached as a note)."""


class RewardTimeout(TimeoutError):
    """A reward call ran past reward.timeout_s."""


def function_identity(function) -> str:
    """module.qualname of a reward, comparable across processes (a worker imports the main script as __mp_main__)."""
    module = getattr(function, "__module__", "?").replace("__mp_main__", "__main__")
    return f"{module}.{getattr(function, '__qualname__', repr(function))}"


def _serve(connection, reward: dict, data_sources: list[str], functions: dict) -> None:
    """A worker's life: rebuild the registry from the reward section (a dict: a RewardConfig would import torch)
    and the functions shipped by reference, report it, then score calls until None or EOF."""
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group: the training process finishes its step
    # (which may still need this worker) and then closes the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        register_functions(reward["functions"], reward["corpus_index"])
        for source, function in functions.items():
            rewards.register(source, function, overwrite=True)
        identities = {source: function_identity(rewards.get_reward(source)) for source in data_sources}
        if (reward["triple_extractor"], reward["cooccurrence_semantics"]) != ("rule", "engine"):
            from grpo.config import RewardConfig  # not the registered default: build it here too (imports torch)
            rewards.register("factqa_corpus", factqa_reward_for(RewardConfig(**reward)), overwrite=True)
    except Exception as error:
        connection.send(("error", f"{type(error).__name__}: {error}", traceback.format_exc()))
        return
    connection.send(("ready", identities, ""))
    with contextlib.suppress(EOFError):  # the pool's end of the pipe closed
        for call in iter(connection.recv, None):
            try:
                outcome = ("ok", rewards.compute_score(*call), "")
            except Exception as error:
                outcome = ("error", f"{type(error).__name__}: {error}", traceback.format_exc())
            connection.send(outcome)


@dataclass
class _Worker:
    process: multiprocessing.Process
    connection: object  # multiprocessing.connection.Connection

    def stop(self) -> None:
        self.process.kill()
        self.process.join()
        self.connection.close()


class RewardPool:
    """reward.num_workers processes scoring (data_source, solution_str, ground_truth, extra_info) calls."""

    def __init__(self, reward: RewardConfig, data_sources: Sequence[str]):
        self.reward, self.data_sources = reward, sorted(set(data_sources))
        # The rewards a worker can receive by reference (module-level functions: a lambda or a nested function
        # cannot be pickled, and must be named by path in reward.functions).
        self.functions = {}
        for source in self.data_sources:
            with contextlib.suppress(pickle.PicklingError, AttributeError, TypeError):
                pickle.dumps(function := rewards.get_reward(source))
                self.functions[source] = function
        self.context = multiprocessing.get_context("forkserver")
        # The fork server imports the rewards once (not the main module, which may import torch and CUDA).
        self.context.set_forkserver_preload(["rewards", "launch.reward_pool"])
        self.workers: list[_Worker | None] = [None] * reward.num_workers

    def start(self) -> None:
        """Start every worker (in parallel); ConfigError (the workers closed) for a main script that trains outside
        `if __name__ == "__main__":` (the fork server imports it again) or a data source whose reward differs there."""
        from grpo.config import ConfigError  # grpo.config imports torch, which the workers do not need
        path = getattr(sys.modules.get("__main__"), "__file__", None)
        if path and os.path.isfile(path) and "__main__" not in open(path, encoding="utf-8", errors="replace").read():
            raise ConfigError(f"reward.num_workers={self.reward.num_workers} starts worker processes that import "
                              f"{path} again: put its training call under `if __name__ == \"__main__\":` (or set "
                              f"reward.num_workers=0)")
        try:
            theirs = self._start_missing()
            for source in self.data_sources:
                ours = function_identity(rewards.get_reward(source))
                if theirs.get(source) != ours:
                    raise ConfigError(
                        f"reward.num_workers={self.reward.num_workers}: data_source {source!r} is {ours} here but "
                        f"{theirs.get(source)} in the reward workers (a reward registered in code does not reach a "
                        f"new process): name it by path in reward.functions, or set reward.num_workers=0")
        except BaseException:
            self.close()
            raise

    def _start_missing(self) -> dict[str, str]:
        """(Re)start the workers not running (never started, or stopped: killed, dead or closed), in parallel;
        {data_source: function identity} as they see it."""
        started = []
        for slot, worker in enumerate(self.workers):
            if worker is None or not worker.process.is_alive():
                here, there = self.context.Pipe()
                process = self.context.Process(target=_serve, name=f"reward-worker-{slot}", daemon=True, args=(
                    there, dataclasses.asdict(self.reward), self.data_sources, self.functions))
                process.start()
                there.close()  # the worker holds its end: EOF here means the worker is gone
                self.workers[slot] = _Worker(process, here)
                started.append(self.workers[slot])
        identities = {}
        for worker in started:
            if not worker.connection.poll(START_TIMEOUT_S):
                raise RewardWorkerError(f"reward worker pid {worker.process.pid} did not start within "
                                        f"{START_TIMEOUT_S:g} s")
            try:
                status, payload, _ = worker.connection.recv()
            except EOFError:
                worker.process.join()
                raise RewardWorkerError(f"reward worker pid {worker.process.pid} died while starting "
                                        f"(exit code {worker.process.exitcode})") from None
            if status != "ready":
                from grpo.config import ConfigError  # grpo.config imports torch, which the workers do not need
                raise ConfigError(f"reward.num_workers: a reward worker could not set up the rewards: {payload}")
            identities = payload
        return identities

    def compute_score(self, data_source, solution_str, ground_truth, extra_info=None):
        """One call, as rewards.compute_score: the result, or the call's error raised."""
        outcome = self.compute_scores([(data_source, solution_str, ground_truth, extra_info)])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def compute_scores(self, calls: Sequence[tuple]) -> list:
        """One outcome per call, in order: the reward's result, or the exception of a call that failed (the reward
        raised, its worker died, or it ran past reward.timeout_s). After the first failure no call is started and
        the calls in flight are abandoned (their workers killed): their outcomes stay None."""
        self._start_missing()  # replaces workers killed or dead since the last call
        outcomes: list = [None] * len(calls)
        waiting = list(range(len(calls)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (call index, deadline)
        limit = self.reward.timeout_s if self.reward.timeout_s is not None else float("inf")
        while busy or waiting:
            for slot, worker in enumerate(self.workers):
                if slot not in busy and waiting:
                    index = waiting.pop()
                    with contextlib.suppress(OSError):  # the worker is gone: found below, as a death while scoring
                        worker.connection.send(calls[index])
                    busy[slot] = (index, time.monotonic() + limit)
            nearest = min(deadline for _, deadline in busy.values())
            handles = [self.workers[s].connection for s in busy] + [self.workers[s].process.sentinel for s in busy]
            multiprocessing.connection.wait(handles, timeout=None if nearest == float("inf")
                                            else max(0.0, nearest - time.monotonic()))
            for slot, (index, deadline) in list(busy.items()):
                outcome = self._outcome(slot, deadline)
                if outcome is not _PENDING:
                    outcomes[index] = outcome
                    del busy[slot]
            if any(isinstance(outcome, BaseException) for outcome in outcomes):
                for slot in busy:  # abandoned: the run ends with the first error
                    self.workers[slot].stop()
                break
        return outcomes

    def _outcome(self, slot: int, deadline: float):
        """The finished call's result or error (the reward's, a timeout, or the worker's death), or _PENDING while
        it runs within its deadline."""
        worker = self.workers[slot]
        if worker.connection.poll():
            with contextlib.suppress(EOFError, OSError):  # nothing to read: the worker died, reported below
                status, payload, remote_traceback = worker.connection.recv()
                if status == "ok":
                    return payload
                error = RewardWorkerError(payload)
                error.add_note(f"in the reward worker:\n{remote_traceback}")
                return error
        elif worker.process.is_alive():
            if time.monotonic() < deadline:
                return _PENDING
            worker.stop()
            return RewardTimeout(f"no result within reward.timeout_s={self.reward.timeout_s:g} s: the call was "
                                 f"abandoned and its worker (pid {worker.process.pid}) killed; a new worker is "
                                 f"started for the next call")
        worker.stop()  # dead: its exit code is read once joined
        code = worker.process.exitcode
        name = f", {signal.Signals(-code).name}" if code is not None and code < 0 else ""
        return RewardWorkerError(f"reward worker pid {worker.process.pid} died while scoring (exit code {code}{name}); "
                                 "a new worker is started for the next call")

    def close(self) -> None:
        """Ask every worker to stop; kill those that do not within 5 s."""
        for worker in filter(None, self.workers):
            with contextlib.suppress(OSError):  # the pipe of a dead or stopped worker is closed
                worker.connection.send(None)
        for worker in filter(None, self.workers):
            worker.process.join(5.0)
            worker.stop()


_PENDING = object()


def register_functions(functions: dict[str, str], corpus_index: str | None) -> None:
    """reward.functions registered by path (in every process), and reward.corpus_index exported as INDEX_ENV."""
    for data_source, dotted in functions.items():
        rewards.register(data_source, rewards.get_reward(dotted), overwrite=True)
    if corpus_index is not None:
        os.environ[INDEX_ENV] = str(corpus_index)


def model_generate_fn(name_or_path: str | None, *, max_new_tokens: int = 48, device: str = "cpu"
                      ) -> Callable[[str], str]:
    """Greedy continuation of a plain-text prompt (no chat template: the extraction prompt is few-shot text)
    by a local causal LM; decoding stops at the next few-shot example ("\\nSentence:") or max_new_tokens."""
    import torch

    from models import load_model, load_tokenizer
    from rollout.hf_engine import HFEngine

    tokenizer = load_tokenizer(name_or_path)
    model = load_model(name_or_path, dtype=torch.float32, device=device).eval().requires_grad_(False)
    # one torch thread: token-by-token decoding of one sequence gains nothing from more (rollout.engine.torch_threads)
    engine = HFEngine(model, tokenizer, shared=False, num_threads=1)

    def generate(prompt: str) -> str:
        ids = tokenizer(prompt)["input_ids"]
        return engine.generate([ids], n=1, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                               stop=["\nSentence:"], seed=0)[0].text

    return generate


def factqa_reward_for(reward: RewardConfig, *, device: str = "cpu") -> Callable[..., dict] | None:
    """The factqa_corpus reward the config asks for, or None for the registered default (rule extractor, engine)."""
    from grpo.config import ConfigError  # grpo.config imports torch, which the workers do not need
    from rewards.corpus import CorpusIndex

    if reward.triple_extractor == "rule" and reward.cooccurrence_semantics == "engine":
        return None
    index_path = reward.corpus_index or os.environ.get(INDEX_ENV)
    if not index_path:
        raise ConfigError("reward.triple_extractor / reward.cooccurrence_semantics need reward.corpus_index "
                          "(build one with: python -m rewards.corpus build --input corpus.jsonl --out DIR)")
    extractor = None
    if reward.triple_extractor == "model":
        extractor = ModelTripleExtractor(model_generate_fn(
            reward.triple_extractor_model, max_new_tokens=reward.triple_extractor_max_new_tokens, device=device))
    return make_factqa_reward(CorpusIndex(index_path, semantics=reward.cooccurrence_semantics), extractor)


def reward_functions(reward: RewardConfig, rows: list[dict], *, device: str = "cpu"):
    """(compute_score, compute_scores or None, the worker pool or None) of a run, for grpo.groups.Scorer: with
    reward.num_workers every call goes through the workers (each builds the configured reward itself); else the
    configured factqa_corpus reward is registered here, as a worker registers its own."""
    register_functions(reward.functions, reward.corpus_index)
    if reward.num_workers:
        pool = RewardPool(reward, [row["data_source"] for row in rows])
        pool.start()
        return pool.compute_score, pool.compute_scores, pool
    if (configured := factqa_reward_for(reward, device=device)) is not None:
        rewards.register("factqa_corpus", configured, overwrite=True)
    return rewards.compute_score, None, None
