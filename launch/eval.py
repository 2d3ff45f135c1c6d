"""Full evaluation of a model on row files: greedy completions, the published tables' metrics per data source
(data/eval_metrics.py), per-example predictions, and markdown tables that compare several evaluated runs.

    python -m launch.eval --model runs/demo/grpo --data runs/demo/data/heldout.jsonl --out runs/demo/eval_grpo
    python -m launch.eval --model default --data dev.jsonl --out eval/base --relaxed --limit 100
    python -m launch.eval compare eval/base runs/demo/eval_sft runs/demo/eval_grpo --out table.md

OUT gets metrics.json, predictions.jsonl (a line per row: prompt, completion, reward, parsed fields) and
report.md; completion_tokens counts the eos token."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

import rewards
from data.eval_metrics import FACTQA, score_example, summarize
from data.jsonio import atomic_write_text, exit_on_bad_input
from data.rows import read_rows
from grpo.evaluate import greedy_completions
from grpo.groups import Scorer
from launch.build import build_engine
from launch.plan import Target
from launch.recipe import load_config
from models import load_tokenizer, render_prompt, resolve_model_dir
from models.chat import prefix_decoder
from models.checkpoint import latest_checkpoint
from rewards.factqa import INDEX_ENV

DEFAULT_BATCH_SIZE = 16


def resolve_model(spec: str) -> Path | None:
    """--model as a path: None for "default", a run's latest complete checkpoint, else resolve_model_dir's."""
    if spec == "default":
        return None
    path = Path(spec).expanduser()
    if path.is_dir() and not (path / "config.json").is_file() and (
            (path / "checkpoints").is_dir() or any(path.glob("step_*"))):
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"--model {path}: run directory without a complete checkpoint "
                                    f"(no step_<n>/ with a COMPLETE marker under {path / 'checkpoints'})")
        return latest
    return resolve_model_dir(spec)


def read_data(paths: list[str], limit: int | None) -> list[dict]:
    """Records of the first `limit` rows of each file, every file read and checked before anything runs."""
    records = []
    for path in paths:
        for number, row in enumerate(read_rows(path)[:limit], start=1):
            extra_info = row.get("extra_info") or {}
            record = {"file": str(path), "row": number, "index": extra_info.get("index"), "messages": row["prompt"],
                      "data_source": row["data_source"], "reward_model": row["reward_model"],
                      "ground_truth": row["reward_model"]["ground_truth"], "extra_info": extra_info}
            try:  # a bad ground truth fails now, naming its row, not after an hour of generation
                score_example({**record, "completion": ""})
            except ValueError as error:
                raise ValueError(f"{path} row {number}: {error}") from None
            records.append(record)
    return records


def reward_sources(records: list[dict]) -> set[str]:
    """Data sources whose reward can be computed here; the others' is left out with a note, not scored as 0."""
    available = set()
    for source in dict.fromkeys(record["data_source"] for record in records):
        try:
            if source == FACTQA and not os.environ.get(INDEX_ENV) and not all(
                    record["extra_info"].get("corpus_index") for record in records if record["data_source"] == source):
                raise ValueError(f"no corpus index ({INDEX_ENV})")
            rewards.get_reward(source)
            available.add(source)
        except ValueError as error:
            print(f"note: no reward_mean for {source}: {error}", file=sys.stderr)
    return available


def evaluate_records(engine, tokenizer, records: list[dict], *, max_new_tokens: int, batch_size: int,
                     relaxed: bool = False) -> tuple[list[dict], dict]:
    """(predictions, {data_source: metrics}): each record completed greedily, rewarded, and scored."""
    prompt_ids = [render_prompt(tokenizer, record["messages"]) for record in records]
    for record, ids in zip(records, prompt_ids):  # named by file and row before any generation
        if len(ids) >= engine.max_context:
            raise ValueError(f"{record['file']} row {record['row']}: the prompt has {len(ids)} tokens, the model's "
                             f"context holds {engine.max_context}")
    with_reward = reward_sources(records)
    completions = greedy_completions(engine, prompt_ids, max_new_tokens=max_new_tokens, batch_size=batch_size)
    scorer = Scorer(rewards.compute_score, decode_prefixes=prefix_decoder(tokenizer))
    predictions = []
    for record, ids, completion in zip(records, prompt_ids, completions):
        scored = record["data_source"] in with_reward  # a record holds what the scorer reads of a row
        reward = scorer.result(record, completion.text, record["row"])["score"] if scored else None
        prediction = {key: record[key] for key in ("file", "row", "index", "data_source")}
        prediction.update(prompt=record["messages"][-1]["content"], prompt_tokens=len(ids), completion=completion.text,
                          completion_tokens=len(completion.completion_ids), finish_reason=completion.finish_reason,
                          ground_truth=record["ground_truth"], reward=reward)
        prediction.update(score_example({**prediction, "extra_info": record["extra_info"]}, relaxed=relaxed))
        predictions.append(prediction)
    return predictions, summarize(predictions)


def _format(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):  # bool included
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3f}"
    return str(value)


def _flatten(metrics: dict) -> dict:
    """Nested metrics (domain_accuracy) become columns `domain_accuracy[math]`."""
    flat = {}
    for key, value in metrics.items():
        flat.update({f"{key}[{inner}]": part for inner, part in value.items()} if isinstance(value, dict)
                    else {key: value})
    return flat


def markdown_tables(runs: dict[str, dict[str, dict]]) -> str:
    """{run name: {data_source: metrics}} -> a markdown table per data source, a row per run, a column per metric."""
    sections = []
    for source in dict.fromkeys(source for metrics in runs.values() for source in metrics):
        rows = {name: _flatten(metrics[source]) for name, metrics in runs.items() if source in metrics}
        columns = list(dict.fromkeys(key for flat in rows.values() for key in flat))
        lines = [f"### {source}", "", "| model | " + " | ".join(columns) + " |",
                 "|---|" + "---:|" * len(columns)]
        for name, flat in rows.items():
            lines.append(f"| {name} | " + " | ".join(_format(flat.get(column)) for column in columns) + " |")
        sections.append("\n".join(lines))
    return "\n\n".join(sections) + "\n"


def load_evaluation(directory: str | os.PathLike) -> dict:
    """The metrics.json a `launch.eval` run wrote into `directory` (or the file itself)."""
    path = Path(directory)
    path = path / "metrics.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (run `python -m launch.eval ... --out {path.parent}` first)")
    try:
        evaluation = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: invalid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(evaluation, dict) or not isinstance(evaluation.get("metrics"), dict):
        raise ValueError(f"{path}: missing field 'metrics' (an object of per-data-source metrics)")
    return evaluation


def run_names(directories: list[str]) -> list[str]:
    """Each directory's own name, or every full path when two share a name (launch.eval compare, launch.plot)."""
    names = [Path(directory).resolve().name for directory in directories]
    return names if len(set(names)) == len(names) else [str(directory) for directory in directories]


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu (hf engine)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--max-model-len", type=int, default=4096, help="vllm: prompt + completion tokens")


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """Each named option that is set must be at least 1 (bad input, reported before any model loads)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def engine_from_args(args: argparse.Namespace, model_dir: Path | None) -> tuple[object, object, str]:
    """(engine, tokenizer, dtype) for add_engine_arguments' options, from training's factory (build_engine)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    tokenizer = load_tokenizer(model_dir)
    cfg = load_config(None, [f"rollout.engine={args.engine}", f"model.dtype={dtype}", f"model.param_dtype={dtype}",
                             f"rollout.max_model_len={args.max_model_len}"])
    target = dataclasses.replace(Target.here(), device=torch.device(device).type)
    engine = build_engine(cfg, target, resolve_model_dir(model_dir), tokenizer, device=torch.device(device))
    return engine, tokenizer, dtype


def evaluate_command(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory, run directory (its latest complete "
                        "checkpoint), 'default' (the embedded SmolLM2-135M-Instruct), or org/name (local HF cache)")
    parser.add_argument("--data", required=True, action="append", help="rows file (.jsonl/.parquet); repeatable")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"prompts per generate call (default {DEFAULT_BATCH_SIZE}; vllm: all at once)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N rows of each file")
    parser.add_argument("--relaxed", action="store_true", help="lenient labels: the one a reply starts with (SciFact)")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    check_positive(args, "limit", "max_new_tokens", "batch_size")
    model_dir = resolve_model(args.model)
    records = read_data(args.data, args.limit)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    batch_size = args.batch_size or (len(records) if args.engine == "vllm" else DEFAULT_BATCH_SIZE)
    engine, tokenizer, dtype = engine_from_args(args, model_dir)
    predictions, metrics = evaluate_records(engine, tokenizer, records, max_new_tokens=args.max_new_tokens,
                                            batch_size=batch_size, relaxed=args.relaxed)
    name = "default" if model_dir is None else Path(args.model).name
    summary = {"model": args.model, "model_dir": None if model_dir is None else str(model_dir), "engine": args.engine,
               "data": [str(path) for path in args.data], "limit": args.limit, "relaxed": args.relaxed,
               "max_new_tokens": args.max_new_tokens, "dtype": dtype, "count": len(predictions), "metrics": metrics}
    report = f"# {name}\n\n{len(predictions)} rows of {', '.join(map(str, args.data))}; greedy, " \
             f"{args.max_new_tokens} new tokens{', relaxed labels' if args.relaxed else ''}\n\n"
    report += markdown_tables({name: metrics})
    atomic_write_text(out / "predictions.jsonl", "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in predictions))
    atomic_write_text(out / "metrics.json", json.dumps(summary, indent=1) + "\n")
    atomic_write_text(out / "report.md", report)
    print(report)


@exit_on_bad_input(2)
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:
        parser = argparse.ArgumentParser(prog="python -m launch.eval compare",
                                         description="markdown tables comparing evaluated runs side by side")
        parser.add_argument("directories", nargs="+", help="launch.eval output directories")
        parser.add_argument("--out", default=None, help="also write the tables to this file")
        args = parser.parse_args(argv[1:])
        evaluations = [load_evaluation(directory) for directory in args.directories]
        names = [f"{name} (relaxed)" if evaluation.get("relaxed") else name
                 for name, evaluation in zip(run_names(args.directories), evaluations)]
        table = markdown_tables({name: evaluation["metrics"] for name, evaluation in zip(names, evaluations)})
        if args.out:
            atomic_write_text(args.out, table)
        print(table)
    else:
        evaluate_command(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
