"""Multi-turn rollouts with tools (rollout/tools.py): the calculator against what a model might write, call parsing,
tool failures as messages, the token layout of tool messages and SFT targets, tool tokens out of the loss, and a
short tool run end to end. The engines' exact-ids test is in test_rollout_engines.py (both engines)."""
import json
import subprocess
import sys
import time

import pytest
import torch

from data.arithmetic import generate_rows
from grpo.groups import Batch, Group
from rewards.arithmetic import arithmetic_reward
from rewards.parsing import extract_block
from rewards.scifact import evidence_items
from rollout.engine import Completion
from rollout.tools import (MAX_CALLS_PER_TURN, Tools, calculator, parse_tool_calls, run_calls, sft_target,
                           tool_message_ids, tool_schemas, toolbox)

TOOL_TURN = "\n<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"  # SmolLM2's ChatML after a turn's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    from models import load_tokenizer
    return load_tokenizer(None)


@pytest.mark.parametrize("expression, value", [("12 * (34 + 5)", "468"), ("7 / 2", "3.5"), ("-3 ** 2", "-9"),
                                               ("2 ** 0.5", "1.41421356237"), ("10 // 3 % 2", "1"),
                                               ("123456789 * 987654321", "121932631112635269")])
def test_calculator_is_exact_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("hostile, says", [
    ("__import__('os').system('rm -rf /')", "only numbers"), ("open('/etc/passwd').read()", "only numbers"),
    ("(1).__class__.__bases__", "only numbers"), ("lambda: 1", "only numbers"), ("[1] * 10**9", "only numbers"),
    ("'a' * 10", "only numbers"), ("x", "only numbers"), ("9 ** 9 ** 9", "exponent"), ("2 ** 65", "exponent"),
    ("1e308 * 10", "range"), ("10 ** 31", "range"), ("(-8) ** (1 / 3)", "range"), ("1 / 0", "division by zero"),
    ("1 +", "not an arithmetic expression"), ("(" * 150 + "1" + ")" * 150, "characters"),
    ("1; import os", "not an arithmetic expression"), ("True + 1", "only numbers")])
def test_calculator_refuses_what_is_not_arithmetic(hostile, says):
    started = time.perf_counter()
    with pytest.raises(ValueError, match=says):
        calculator(hostile)
    assert time.perf_counter() - started < 1.0


def test_tool_calls_are_parsed_and_malformed_ones_become_messages():
    call = {"name": "calculator", "arguments": {"expression": "1 + 2"}}
    text = f"Let me compute. <tool_call>{json.dumps(call)}</tool_call> and <tool_call>{{oops</tool_call> " \
           '<tool_call>["calculator"]</tool_call><tool_call>{"name": "calculator"}</tool_call><tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed[0] == call and parsed[3] == {"name": "calculator", "arguments": {}}
    assert parsed[1].startswith("error: the tool call is not valid JSON")
    assert parsed[2].startswith("error: a tool call must be")
    assert parsed[4] == "error: a <tool_call> without its </tool_call>"
    assert parse_tool_calls("no call here") == []
    many = parse_tool_calls(f"<tool_call>{json.dumps(call)}</tool_call>" * (MAX_CALLS_PER_TURN + 2))
    assert len(many) == MAX_CALLS_PER_TURN + 1 and many[-1].startswith(f"error: at most {MAX_CALLS_PER_TURN}")


def hang(seconds: int) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(seconds)
    return "late"


def fail(what: str) -> str:
    """Always raise.

    Args:
        what: the error's text.
    """
    raise RuntimeError(what)


def test_failing_hanging_and_misused_tools_answer_with_a_message():
    box = {"calculator": calculator, "hang": hang, "fail": fail}
    calls = [{"name": "calculator", "arguments": {"expression": "6 * 7"}},
             {"name": "hang", "arguments": {"seconds": 60}},
             {"name": "fail", "arguments": {"what": "disk on fire"}},
             {"name": "calculator", "arguments": {"expression": 42}},
             {"name": "calculator", "arguments": {"expression": "1", "shell": "rm"}},
             {"name": "search", "arguments": {}},
             "error: the tool call is not valid JSON (...)"]
    started = time.perf_counter()
    results = run_calls([(box, call) for call in calls], timeout_s=0.5)
    assert time.perf_counter() - started < 5.0  # the hanging tool costs one timeout, not 60 s
    assert results[0] == ("42", "ok")
    assert results[1] == ("error: the tool did not answer within rollout.tool_timeout_s=0.5 s", "timeout")
    assert results[2] == ("error: RuntimeError: disk on fire", "error")
    assert results[3] == ("error: TypeError: argument 'expression' must be str, got int", "error")
    assert results[4][1] == "error" and "shell" in results[4][0]
    assert results[5] == ("error: no tool named 'search'; the tools: calculator, hang, fail", "error")
    assert results[6] == ("error: the tool call is not valid JSON (...)", "error")


def test_tool_messages_are_the_templates_ids_after_the_turn(tokenizer):
    eos = tokenizer.eos_token_id
    # After a turn that ended with the model's own <|im_end|>, the template's end of turn is not repeated.
    assert tool_message_ids(tokenizer, ["42"], eos) == tokenizer.encode(TOOL_TURN.format("42"),
                                                                        add_special_tokens=False)
    # After a turn cut by a stop string, the end-of-turn token is the template's: the tool side's, masked.
    plain = tokenizer.encode("</tool_call>", add_special_tokens=False)[-1]
    assert tool_message_ids(tokenizer, ["42"], plain) == [eos] + tokenizer.encode(TOOL_TURN.format("42"),
                                                                                  add_special_tokens=False)
    two = tokenizer.decode(tool_message_ids(tokenizer, ["1", "2"], eos))
    assert two == "\n<|im_start|>tool\n1<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"


def test_a_multi_turn_sft_target_is_laid_out_as_a_rollout(tokenizer):
    row = generate_rows(1, seed=3)[0]
    ids, mask = sft_target(tokenizer, row["extra_info"]["target"])
    call, result, answer = (message["content"] for message in row["extra_info"]["target"])
    first = tokenizer.encode(call, add_special_tokens=False) + [tokenizer.eos_token_id]
    tool = tool_message_ids(tokenizer, [result], tokenizer.eos_token_id)
    last = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert ids == first + tool + last
    assert mask == [1] * len(first) + [0] * len(tool) + [1] * len(last)
    assert sft_target(tokenizer, "plain") == (tokenizer.encode("plain", add_special_tokens=False)
                                              + [tokenizer.eos_token_id], [1] * 2)
    for bad, says in [([{"role": "tool", "content": "1"}], "first message"),
                      ([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "1"}], "last message"),
                      ([{"role": "user", "content": "a"}], "message 0 must be")]:
        with pytest.raises(ValueError, match=says):
            sft_target(tokenizer, bad)


def test_sft_trains_the_models_turns_only(tokenizer):
    from grpo.trainer import sft_batch

    examples = [([1, 2], *sft_target(tokenizer, row["extra_info"]["target"])) for row in generate_rows(2, seed=4)]
    batch = sft_batch(examples, pad_id=0)
    for row, (_, ids, mask) in enumerate(examples):
        assert batch["completion_mask"][row, :len(ids)].tolist() == mask and 0 in mask
        assert batch["completion_mask"][row, len(ids):].sum() == 0


def test_tool_tokens_carry_no_loss_advantage_or_gradient():
    """Batch.mask is 0 on tool tokens; the loss, advantages and gradient at those positions are 0, and changing
    the tool tokens' logprobs or advantages changes nothing."""
    from grpo.advantages import compute_advantages
    from grpo.config import AlgorithmConfig
    from grpo.losses import loss_denominator, rl_loss

    completions = [Completion([1], [5, 6, 7, 8, 9], "", [-1.0] * 5, "stop", mask=[1, 1, 0, 0, 1]),
                   Completion([1], [5, 6, 7], "", [-1.0] * 3, "stop")]
    group = Group(completions, [{}] * 2, torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), torch.zeros(2, 5), {})
    batch = Batch.from_groups([group], [1.0], rounds=1)
    assert batch.mask.tolist() == [[1, 1, 0, 0, 1], [1, 1, 1, 0, 0]] and batch.lengths.tolist() == [3, 3]
    advantages = compute_advantages("grpo", batch.rewards, batch.token_shaping, batch.mask, 2)
    assert advantages[0, 2:4].tolist() == [0.0, 0.0] and advantages[0, 0] > 0

    algo = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0)  # every term of the loss

    def loss_and_grad(tool_value: float, tool_advantage: float):
        logprobs, others = torch.full((2, 5), -1.0), torch.full((2, 5), -1.2)
        logprobs[0, 2:4] = others[0, 2:4] = tool_value  # the tool tokens' current, old, reference and rollout
        logprobs.requires_grad_(True)
        perturbed = advantages.clone()
        perturbed[0, 2:4] = tool_advantage
        loss, _ = rl_loss(algo, logprobs, others, perturbed, batch.mask, rollout_logprobs=others,
                          denominator=loss_denominator(batch.mask, algo.agg), ref_logprobs=others,
                          entropy=-logprobs.exp() * logprobs)
        loss.backward()
        return float(loss.detach()), logprobs.grad

    loss, grad = loss_and_grad(-1.0, 0.0)
    assert grad[0, 2:4].tolist() == [0.0, 0.0] and grad[0, 0] != 0
    other_loss, other_grad = loss_and_grad(-7.0, 5.0)
    assert other_loss == loss and torch.equal(other_grad, grad)


def test_rows_without_tools_complete_in_one_turn_and_budgets_truncate(tokenizer, tiny_model_dir):
    from models import load_model, render_prompt
    from rollout.hf_engine import HFEngine

    engine = HFEngine(load_model(str(tiny_model_dir)), tokenizer, shared=False)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": "Hi."}])]
    request = dict(n=2, max_new_tokens=14, temperature=1.0, top_p=1.0, top_k=0, stop=[" "], seed=3)
    tools = Tools(tokenizer, {"with_tools": ["calculator"]}, max_turns=4, timeout_s=5.0,
                  parse=lambda text: [{"name": "calculator", "arguments": {"expression": "1 + 1"}}])
    plain = tools.generate(engine, prompts, [{"data_source": "other"}], **request)
    assert [c.completion_ids for c in plain] == [c.completion_ids for c in engine.generate(prompts, **request)]
    assert all(c.mask is None and c.tool_stats is None for c in plain)
    # A 14-token budget: a turn and a tool message (12 ids) rarely leave room for a reply; whatever does not fit
    # ends the trajectory as a truncation, never past the budget.
    tight = tools.generate(engine, prompts, [{"data_source": "with_tools"}], **request)
    for completion in tight:
        assert len(completion.completion_ids) <= 14 and len(completion.mask) == len(completion.completion_ids)
        assert completion.finish_reason == "length" or completion.tool_stats["turns"] == 4
    assert any(c.finish_reason == "length" and c.tool_stats["calls"] >= 1 for c in tight)


def test_tools_are_named_and_checked_at_start_up(tmp_path, tiny_model_dir):
    from grpo.config import ConfigError
    from launch.dist import DistInfo
    from launch.preflight import prepare
    from launch.recipe import load_config

    assert list(toolbox(["calculator"])) == ["calculator"]
    assert tool_schemas(["calculator"])[0]["function"]["parameters"]["required"] == ["expression"]
    rows = generate_rows(2, seed=0)
    for tools, says in [("{arithmetic: [no_such_tool]}", "rollout.tools.arithmetic: unknown tool 'no_such_tool'"),
                        ("{arithmetic: ['tests.test_tools:undocumented']}", "no JSON schema")]:
        cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}", f"rollout.tools={tools}",
                                 f"trainer.out_dir={tmp_path}"])
        with pytest.raises(ConfigError, match=says):
            prepare(cfg, DistInfo(), rows=rows)


def undocumented(x):
    return x


def test_arithmetic_reward_reads_the_last_answer():
    assert arithmetic_reward("arithmetic", "tool\n<answer>5</answer>\n<answer>1,234</answer>", "1234")["score"] == 1
    assert arithmetic_reward("arithmetic", "<answer>1234</answer> <answer>7</answer>", "1234") == {
        "score": 0.0, "format": 1.0, "acc": 0.0}
    assert arithmetic_reward("arithmetic", "1234", "1234")["format"] == 0.0
    assert arithmetic_reward("arithmetic", "<answer>,</answer>", "1")["format"] == 0.0  # not a number: no answer
    with pytest.raises(ValueError, match="invalid literal for int.*'twelve'"):
        arithmetic_reward("arithmetic", "", "twelve")


def test_a_tool_run_trains_and_logs_its_turns(tmp_path, tiny_model_dir, monkeypatch):
    """Two GRPO steps on the arithmetic rows with the calculator on the tiny model: the rollouts are multi-turn
    (the tiny model never writes a call by itself, so every turn is read as one, a malformed one), the metrics
    count the turns and the failed calls, samples.jsonl holds the conversation, and the update has a gradient."""
    import re

    from launch.api import train

    monkeypatch.setattr("rollout.tools.TOOL_CALL", re.compile(r"(.+)", re.DOTALL))
    train(None, overrides=[
        f"model.name_or_path={tiny_model_dir}", "rollout.tools={arithmetic: [calculator]}", "rollout.max_turns=2",
        "reward.functions={arithmetic: 'rewards_for_tests:vowel_fraction'}",  # a reward that varies: a gradient
        "rollout.n=2", "rollout.max_new_tokens=40", "rollout.stop=[' ']", "trainer.steps=2",
        "trainer.prompts_per_step=2", "trainer.micro_batch_size=4", "optim.lr=1e-3", "trainer.checkpoint=none",
        f"trainer.out_dir={tmp_path}", "trainer.run_name=tools"], train_rows=generate_rows(4, seed=0))
    run_dir = tmp_path / "tools"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 1 < m["turns_mean"] <= 2 and m["tool_calls"] > 0 and m["tool_errors"] == m["tool_calls"]
        assert m["tool_timeouts"] == 0 and m["grad_norm"] > 0
    sample = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert "\ntool\nerror: the tool call is not valid JSON" in sample["completion"]


@pytest.fixture(scope="module")
def scifact_search(shared_data, tmp_path_factory):
    """SciFact rows for the search tool and its index over the whole corpus (data.scifact --search)."""
    from data.scifact import main as convert

    root = tmp_path_factory.mktemp("scifact_search")
    convert(["--input", str(shared_data / "scifact"), "--out", str(root), "--search"])
    return root


def test_search_returns_corpus_sentences_with_their_ids(scifact_search, shared_data, monkeypatch):
    from data.scifact import load_corpus
    from rollout.search import INDEX_ENV, TOP_K, search, top_sentences

    monkeypatch.setenv(INDEX_ENV, str(scifact_search / "search_index"))
    corpus = load_corpus(shared_data / "scifact" / "corpus.jsonl")
    doc_id, document = next(iter(corpus.items()))
    hits = search(document["abstract"][1]).splitlines()
    assert len(hits) == TOP_K and hits[0] == f"[doc {doc_id}, sentence 1] {' '.join(document['abstract'][1].split())}"
    assert search("the of and") == "no results: the query has no searchable words"
    # Without numba: once llvmlite is imported, vLLM's CPU start-up fails in the same process.
    code = "import sys, rollout.search as s; s._bm25s(); assert 'bm25s' in sys.modules and 'llvmlite' not in " \
           "sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    rows = [json.loads(line) for line in (scifact_search / "train.jsonl").read_text().splitlines()]
    prompt = rows[0]["prompt"][0]["content"]
    claim = prompt.splitlines()[0].removeprefix("Claim: ")
    assert '"search"' in prompt and "Title:" not in prompt and "[0]" not in prompt  # the model has to search
    # The SFT target: the claim as the query, the tool's real answer, the label with the gold sentences it holds.
    call, answer, final = rows[0]["extra_info"]["target"]
    assert json.loads(call["content"].removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
        "name": "search", "arguments": {"query": claim}}
    assert answer == {"role": "tool", "content": top_sentences(str(scifact_search / "search_index"), claim)}
    cited = {row["extra_info"]["index"]: evidence_items(extract_block(row["extra_info"]["target"][2]["content"],
                                                                        "evidence")) for row in rows}
    gold = {row["extra_info"]["index"]: json.loads(row["reward_model"]["ground_truth"])["evidence"] for row in rows}
    for row in rows:
        found = row["extra_info"]["target"][1]["content"]
        assert cited[row["extra_info"]["index"]] == [s for s in gold[row["extra_info"]["index"]] if s in found]
    assert final["role"] == "assistant" and final["content"].startswith(f"<answer>\n{rows[0]['extra_info']['label']}")
    assert 50 < sum(map(bool, cited.values())) < sum(map(bool, gold.values()))  # found for some claims, not all


def test_veriseek_search_recipe_checks_on_both_targets(scifact_search, tiny_model_dir, tmp_path, monkeypatch):
    from pathlib import Path

    from launch.train import main

    recipe = Path(__file__).resolve().parents[1] / "launch" / "configs" / "veriseek_search.yaml"
    data = [f"data.train_files=['{scifact_search / 'train.jsonl'}']",
            f"data.eval_files=['{scifact_search / 'dev.jsonl'}']",
            f"rollout.search_index={scifact_search / 'search_index'}", f"trainer.out_dir={tmp_path}"]
    qwen = Path(__file__).resolve().parent / "data" / "models" / "qwen3-4b" / "config.json"
    assert main(["--config", str(recipe), "--dry-run", "--device", "cuda", "--world-size", "2", "--gpu-memory-gib",
                 "80", "--model-config", str(qwen), *data]) == 0
    assert main(["--config", str(recipe), "--dry-run", f"model.name_or_path={tiny_model_dir}",
                 "model.param_dtype=float32", *data]) == 0
    assert main(["--config", str(recipe), "--dry-run", f"model.name_or_path={tiny_model_dir}",
                 "model.param_dtype=float32", *data[:2], "rollout.search_index=null"]) == 2
    assert main(["--config", str(recipe), "--dry-run", f"model.name_or_path={tiny_model_dir}",
                 "model.param_dtype=float32", *data[:2], f"rollout.search_index={tmp_path}"]) == 2
