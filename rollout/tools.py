"""Multi-turn rollouts with tools: the model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes
/ Qwen3 style), the tool's answer comes back as the chat template's `tool` message, and the model goes on, for up
to rollout.max_turns turns. A trajectory is token ids, never re-tokenised text: each turn's sampled ids, then the
template's ids of the tool messages; `Completion.mask` is 0 on the latter, so no loss term trains them. A tool is a
typed, documented function, or an environment class (one instance per trajectory, `reset(row)`, its public methods
the tools). Arguments are untrusted: JSON, bound and type-checked, never evaluated; failures and timeouts become
tool messages. The rules in full: docs/conventions.md, "Multi-turn trajectories with tools"."""
from __future__ import annotations

import ast
import inspect
import json
import operator
import re
import threading
import time
import typing
from collections import Counter
from collections.abc import Callable, Sequence

from rewards import load_function
from rollout.engine import Completion, completion_text, stream_seed

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_CALLS_PER_TURN = 8  # more calls in one turn are answered with an error: a turn cannot fan out unboundedly
MAX_RESULT_CHARS = 2000  # a tool's answer is cut here (it costs context tokens of every later turn)
_PROBE = "\u2063nanogrpo-turn\u2063"  # assistant content no template alters: where a turn's text ends
_TOOLS: dict[str, Callable] = {}
SHIPPED = {"search": "rollout.search:search"}  # tools in modules of their own, imported when a run names them


def register_tool(tool: Callable) -> Callable:
    """Register a tool function or environment class under its __name__ (the name the model calls it by)."""
    _TOOLS[tool.__name__] = tool
    return tool


def get_tool(name: str) -> Callable:
    """A registered tool, or the function or class a path names ("package.module:name", "file.py:name")."""
    if name in _TOOLS:
        return _TOOLS[name]
    try:
        return load_function(SHIPPED.get(name, name))
    except ValueError as error:
        raise ValueError(f"unknown tool {name!r} ({error}); the tools: {', '.join(sorted([*_TOOLS, *SHIPPED]))}; or "
                         f"give a path 'package.module:function' or 'file.py:function'") from None


def toolbox(names: Sequence[str], row: dict | None = None) -> dict[str, Callable]:
    """{name the model calls: callable} for one trajectory: functions as they are, and the public methods of a
    fresh instance of each environment class (reset with `row` when given)."""
    box = {}
    for name in names:
        tool = get_tool(name)
        if not isinstance(tool, type):
            box[tool.__name__] = tool
            continue
        environment = tool()
        if row is not None:
            environment.reset(row)
        box.update({method: getattr(environment, method) for method in dir(environment)
                    if not method.startswith("_") and method != "reset" and callable(getattr(environment, method))})
    return box


def tool_schemas(names: Sequence[str]) -> list[dict]:
    """The JSON schemas of the tools `names` give a trajectory, for the chat template's `tools` (start-up checks
    them: a tool without typed arguments or an Args docstring section fails here, naming it)."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, function in toolbox(names).items():
        try:
            schemas.append(get_json_schema(function))
        except Exception as error:
            raise ValueError(f"tool {name!r}: no JSON schema ({error}); a tool needs type hints on every argument "
                             f"and a docstring with an Args section") from None
    return schemas


def parse_tool_calls(text: str) -> list[dict | str]:
    """The `<tool_call>` blocks of one turn's text, in order: {"name", "arguments"}, or for a malformed block the
    message the model gets back instead."""
    blocks = TOOL_CALL.findall(text)
    calls: list[dict | str] = []
    for block in blocks[:MAX_CALLS_PER_TURN]:
        try:
            call = json.loads(block)
        except json.JSONDecodeError as error:
            calls.append(f"error: the tool call is not valid JSON ({error.msg} at column {error.colno})")
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.setdefault("arguments", {}), dict)):
            calls.append('error: a tool call must be {"name": "...", "arguments": {...}}')
            continue
        calls.append(call)
    if len(blocks) > MAX_CALLS_PER_TURN:
        calls.append(f"error: at most {MAX_CALLS_PER_TURN} tool calls per turn; the rest were not run")
    if text.count("<tool_call>") > len(blocks):
        calls.append("error: a <tool_call> without its </tool_call>")
    return calls


def _bind(function: Callable, arguments: dict) -> dict:
    """The arguments checked against the signature and its str/int/float/bool hints (TypeError naming them)."""
    bound = inspect.signature(function).bind(**arguments).arguments
    hints = typing.get_type_hints(function)
    for name, value in bound.items():
        expected = hints.get(name)
        ok = {str: isinstance(value, str), bool: isinstance(value, bool),
              int: isinstance(value, int) and not isinstance(value, bool),
              float: isinstance(value, (int, float)) and not isinstance(value, bool)}.get(expected, True)
        if not ok:
            raise TypeError(f"argument {name!r} must be {expected.__name__}, got {type(value).__name__}")
    return bound


def run_calls(calls: Sequence[tuple[dict[str, Callable], dict | str]], timeout_s: float) -> list[tuple[str, str]]:
    """(tool message, status) per (toolbox, call), all run at once in daemon threads; status "ok", "error" or
    "timeout". A call still running after timeout_s is abandoned (its thread cannot be killed; it ends with the
    process), so a hanging tool costs one timeout per turn, never a stalled step."""
    results: list[tuple[str, str] | None] = [None] * len(calls)

    def run(index: int, function: Callable, arguments: dict) -> None:
        try:
            results[index] = (str(function(**_bind(function, arguments)))[:MAX_RESULT_CHARS], "ok")
        except Exception as error:
            results[index] = (f"error: {type(error).__name__}: {error}"[:MAX_RESULT_CHARS], "error")

    threads = []
    for index, (box, call) in enumerate(calls):
        if isinstance(call, str):
            results[index] = (call, "error")
        elif call["name"] not in box:
            results[index] = (f"error: no tool named {call['name']!r}; the tools: {', '.join(box) or 'none'}", "error")
        else:
            threads.append(threading.Thread(target=run, args=(index, box[call["name"]], call["arguments"]),
                                            daemon=True))
            threads[-1].start()
    end = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    return [result or (f"error: the tool did not answer within rollout.tool_timeout_s={timeout_s:g} s", "timeout")
            for result in results]


def tool_message_ids(tokenizer, contents: Sequence[str], last_id: int) -> list[int]:
    """The ids that follow an assistant turn whose last sampled token is `last_id`: the turn's end as the chat
    template writes it (unless the model sampled that token itself), the tool messages, and the next assistant
    turn's header, rendered by the template and encoded once (never the model's own text)."""
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
    messages += [{"role": "tool", "content": content} for content in contents]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = text[text.index(_PROBE) + len(_PROBE):]
    ended = tokenizer.decode([last_id])
    if last_id in tokenizer.all_special_ids and text.startswith(ended):
        text = text[len(ended):]
    return tokenizer.encode(text, add_special_tokens=False)


def sft_target(tokenizer, target: str | Sequence[dict]) -> tuple[list[int], list[int]]:
    """An SFT row's target as (ids, mask): a string is one assistant turn (its ids and the end of sequence, all
    trained); a list of {"role": "assistant" | "tool", "content"} messages is laid out as a rollout lays out a
    trajectory: each assistant turn's ids and end of sequence (mask 1), each run of tool messages as
    tool_message_ids renders it (mask 0), so SFT teaches exactly the token layout the rollouts produce."""
    if isinstance(target, str):
        target = [{"role": "assistant", "content": target}]
    ids: list[int] = []
    mask: list[int] = []
    tool_run: list[str] = []
    for index, message in enumerate(target):
        if not (isinstance(message, dict) and message.get("role") in ("assistant", "tool")
                and isinstance(message.get("content"), str)):
            raise ValueError(f"target message {index} must be {{'role': 'assistant' or 'tool', 'content': str}}, "
                             f"got {message!r:.100}")
        if message["role"] == "tool":
            if not ids:
                raise ValueError("a target's first message must be the assistant's")
            tool_run.append(message["content"])
            continue
        if tool_run:
            message_ids = tool_message_ids(tokenizer, tool_run, ids[-1])
            ids, mask, tool_run = ids + message_ids, mask + [0] * len(message_ids), []
        turn = tokenizer.encode(message["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
        ids, mask = ids + turn, mask + [1] * len(turn)
    if tool_run:
        raise ValueError("a target's last message must be the assistant's")
    return ids, mask


class Tools:
    """The tools of a run: rollout.tools {data_source: [tool names]}, and the turn loop that uses them.

    `generate` is an engine's generate with the prompts' rows: rows whose data source has no tools complete in
    one turn, as without this class."""

    def __init__(self, tokenizer, tools: dict[str, list[str]], *, max_turns: int, timeout_s: float,
                 parse: Callable[[str], list[dict | str]] = parse_tool_calls):
        self.tokenizer, self.tools, self.max_turns, self.timeout_s, self.parse = (
            tokenizer, tools, max_turns, timeout_s, parse)

    def generate(self, engine, prompts: list[list[int]], rows: Sequence[dict], *, n: int, max_new_tokens: int,
                 seed: int | None, **sampling) -> list[Completion]:
        """n trajectories per prompt (rows[i] is prompts[i]'s row), as engine.generate orders its completions.
        Turn k > 0 continues every live trajectory from its ids with its own seed stream (stream_seed(seed, k));
        a turn gets the longest remaining budget and is cut to its own (a prefix of a sample is a sample)."""
        names = [self.tools.get(row["data_source"], []) for row in rows]
        if not any(names):
            return engine.generate(prompts, n=n, max_new_tokens=max_new_tokens, seed=seed, **sampling)
        size = len(prompts) * n
        boxes = [toolbox(names[b // n], rows[b // n]) if names[b // n] else None for b in range(size)]
        ids, logprobs, mask = [[] for _ in range(size)], [[] for _ in range(size)], [[] for _ in range(size)]
        stats = [Counter(turns=0, calls=0, error=0, timeout=0) for _ in range(size)]
        finish, live = ["stop"] * size, list(range(size))
        for turn in range(self.max_turns):
            if turn == 0:
                outputs = engine.generate(prompts, n=n, max_new_tokens=max_new_tokens, seed=seed, **sampling)
            else:
                outputs = engine.generate([prompts[b // n] + ids[b] for b in live], n=1, **sampling,
                                          max_new_tokens=max(max_new_tokens - len(ids[b]) for b in live),
                                          seed=None if seed is None else stream_seed(seed, turn))
            asking = []
            for b, output in zip(live, outputs):
                room = max_new_tokens - len(ids[b])
                turn_ids = output.completion_ids[:room]
                ids[b] += turn_ids
                logprobs[b] += output.logprobs[:room]
                mask[b] += [1] * len(turn_ids)
                stats[b]["turns"] += 1
                if output.finish_reason == "length" or len(output.completion_ids) > room:
                    finish[b] = "length"
                elif boxes[b] is not None and turn + 1 < self.max_turns and (calls := self.parse(output.text)):
                    asking.append((b, calls))
            answers = iter(run_calls([(boxes[b], call) for b, calls in asking for call in calls], self.timeout_s))
            live = []
            for b, calls in asking:
                results = [next(answers) for _ in calls]
                stats[b].update([status for _, status in results], calls=len(calls))  # calls by status too
                message = tool_message_ids(self.tokenizer, [content for content, _ in results], ids[b][-1])
                if len(ids[b]) + len(message) >= max_new_tokens:  # no room for the model's reply: truncated
                    finish[b] = "length"
                    continue
                ids[b] += message
                logprobs[b] += [0.0] * len(message)
                mask[b] += [0] * len(message)
                live.append(b)
            if not live:
                break
        return [Completion(list(prompts[b // n]), ids[b], completion_text(self.tokenizer, ids[b]), logprobs[b],
                           finish[b], mask=mask[b] if boxes[b] is not None else None,
                           tool_stats=stats[b] if boxes[b] is not None else None) for b in range(size)]


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
CALCULATOR_LIMIT = 10.0 ** 30  # the largest magnitude any step of a calculation may reach


def _arithmetic(node: ast.AST) -> int | float:
    """The value of a parsed expression of numbers and + - * / // % ** (ValueError for anything else)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_arithmetic(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError(f"exponent {right} is too large (at most 64)")
        value = _BINARY[type(node.op)](left, right)
    else:
        raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")
    if isinstance(value, complex) or not abs(value) <= CALCULATOR_LIMIT:
        raise ValueError(f"a step of the calculation leaves the range +-{CALCULATOR_LIMIT:g}")
    return value


@register_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay integers).

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "12 * (34 + 5)".
    """
    if len(expression) > 200:
        raise ValueError(f"the expression has {len(expression)} characters; at most 200")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {expression[:60]!r}") from None
    try:
        value = _arithmetic(tree.body)
    except (ZeroDivisionError, OverflowError) as error:
        raise ValueError(f"{error}") from None
    return str(value) if isinstance(value, int) else f"{value:.12g}"
