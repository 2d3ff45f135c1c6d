"""Plots for runs as PNG (matplotlib's Agg renderer, no display needed): training_curves.png, a line per run, and
eval_comparison.png, a bar per model, written into --out.

    python -m launch.plot runs/demo/sft runs/demo/grpo --out runs/demo/plots
    python -m launch.plot runs/demo/grpo runs/demo/eval_base runs/demo/eval_grpo"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from data.jsonio import exit_on_bad_input, iter_jsonl
from launch.eval import load_evaluation, run_names

# (metrics.jsonl key, panel title), drawn when any run logged the key. SFT runs log only "loss".
CURVES = (("eval/reward", "held-out reward (greedy)"), ("eval/acc", "held-out label accuracy (greedy)"),
          ("reward_mean", "training reward"), ("acc", "accuracy"), ("format_rate", "format success"),
          ("response_length_mean", "response length (tokens)"), ("kl", "KL"), ("entropy", "entropy"),
          ("loss", "SFT loss"))
# (metrics key, bar label) per data source; a source not listed shows its reward_mean.
HEADLINE = {
    "scifact_evidence": (("answer_accuracy", "answer accuracy"), ("evidence_f1", "evidence F1")),
    "factqa_corpus": (("correct_rate", "correct"), ("f1", "F1")),
    "verifier": (("accuracy", "accuracy"),),
    "held-out (trainer)": (("acc", "accuracy"), ("format", "format success")),
}


def _number(value) -> float:
    """A logged value as a float: a number or a numeric string ("nan", "inf") as such, anything else (null) NaN."""
    try:
        return float(value) if isinstance(value, (int, float, str)) else math.nan
    except ValueError:
        return math.nan


def read_metrics(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl, none for an empty file (a run stopped before its first step)."""
    if path.stat().st_size == 0:
        return []
    records = []
    for where, record in iter_jsonl(path):
        if not isinstance(record.get("step"), int):
            raise ValueError(f"{where}: expected an object with an integer 'step'")
        records.append(record)
    return records


def read_evaluations(directory: Path, name: str) -> dict[str, dict[str, dict]]:
    """{model name: {data_source: metrics}} from a launch.eval metrics.json, and from a run's eval.json (as
    "NAME before" / "NAME after" under "held-out (trainer)")."""
    evaluations, path = {}, directory / "eval.json"
    if (directory / "metrics.json").is_file():
        evaluations[name] = load_evaluation(directory)["metrics"]
    if path.is_file():
        try:
            held_out = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: invalid JSON ({error.msg} at line {error.lineno})") from None
        if not isinstance(held_out, dict):
            raise ValueError(f"{path}: expected an object with 'before' and 'after'")
        for moment in ("before", "after"):
            means = held_out.get(moment, {}).get("means") if isinstance(held_out.get(moment), dict) else None
            if isinstance(means, dict) and means:  # {metric: {mean, low, high}} (launch.train)
                evaluations[f"{name} {moment}"] = {"held-out (trainer)": {
                    metric: _number(interval.get("mean")) for metric, interval in means.items()
                    if isinstance(interval, dict)}}
    return evaluations


def _grid(panels: int, width: float, height: float) -> tuple[Figure, list]:
    columns = min(3, panels)
    rows = math.ceil(panels / columns)
    figure = Figure(figsize=(width * columns, height * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for unused in axes[panels:]:
        unused.set_visible(False)
    return figure, axes


def training_curves(runs: dict[str, list[dict]], path: Path, curves=CURVES) -> list[str]:
    """One PNG, a panel per `curves` key any run logged, a line per run (with its 95% band where the run logged
    KEY_low / KEY_high, as held-out scores are); returns the keys drawn."""
    logged = {key for records in runs.values() for record in records for key in record}
    keys = [(key, title) for key, title in curves if key in logged]
    if not keys:
        return []
    figure, axes = _grid(len(keys), 4.5, 3.2)
    colours = {name: f"C{index % 10}" for index, name in enumerate(runs)}  # a run keeps its colour in every panel
    for axis, (key, title) in zip(axes, keys):
        for name, records in runs.items():
            points = [(record["step"], _number(record[key])) for record in records if key in record]
            points = [(step, value) for step, value in points if math.isfinite(value)]
            if points:
                axis.plot(*zip(*points), marker="." if len(points) < 30 else None, color=colours[name])
                band = [(r["step"], _number(r[f"{key}_low"]), _number(r[f"{key}_high"])) for r in records
                        if f"{key}_low" in r and f"{key}_high" in r]
                band = [b for b in band if math.isfinite(b[1]) and math.isfinite(b[2])]
                if band:
                    steps, lows, highs = zip(*band)
                    axis.fill_between(steps, lows, highs, color=colours[name], alpha=0.15, linewidth=0)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    axes[0].legend([Line2D([], [], color=colours[name], marker=".") for name in runs], list(runs), fontsize="small")
    figure.savefig(path, dpi=100)
    return [key for key, _ in keys]


def evaluation_bars(evaluations: dict[str, dict[str, dict]], path: Path) -> list[str]:
    """One PNG, a panel of headline-metric bars per data source, a colour per model; returns the sources drawn."""
    sources = list(dict.fromkeys(source for metrics in evaluations.values() for source in metrics))
    if not sources:
        return []
    figure, axes = _grid(len(sources), 5.0, 3.6)
    for axis, source in zip(axes, sources):
        models = [name for name, metrics in evaluations.items() if source in metrics]
        # A metric no model has (a custom reward without a format component) gets no bar.
        labels = [(key, label) for key, label in HEADLINE.get(source, (("reward_mean", "reward"),))
                  if any(math.isfinite(_number(evaluations[name][source].get(key))) for name in models)] or [
                  ("reward_mean", "reward")]
        width = 0.8 / len(models)
        for position, name in enumerate(models):
            values = [_number(evaluations[name][source].get(key)) for key, _ in labels]
            offsets = [index - 0.4 + width * (position + 0.5) for index in range(len(labels))]
            bars = axis.bar(offsets, [0.0 if math.isnan(value) else value for value in values], width, label=name)
            axis.bar_label(bars, labels=["n/a" if math.isnan(value) else f"{value:.2f}" for value in values],
                           fontsize="x-small")
        axis.set_xticks(range(len(labels)), [label for _, label in labels])
        if source in HEADLINE:  # every headline metric is a rate in [0, 1]
            axis.set_ylim(0, 1.1)
        axis.set_title(source)
        axis.legend(fontsize="x-small")
    figure.savefig(path, dpi=100)
    return sources


def plot_runs(directories: list[str], out: Path) -> list[Path]:
    """Read every directory first (errors name the directory or file), then draw; returns the PNG paths."""
    paths = [Path(directory) for directory in directories]
    runs, evaluations = {}, {}
    for path, name in zip(paths, run_names(directories)):
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such directory")
        if (path / "metrics.jsonl").is_file():
            runs[name] = read_metrics(path / "metrics.jsonl")
        found = read_evaluations(path, name)
        evaluations.update(found)
        if name not in runs and not found:
            raise FileNotFoundError(f"{path}: no metrics.jsonl, eval.json or metrics.json (neither a run "
                                    "directory nor a launch.eval output)")
    out.mkdir(parents=True, exist_ok=True)
    drawings = ((training_curves, runs, out / "training_curves.png"),
                (evaluation_bars, evaluations, out / "eval_comparison.png"))
    written = [path for draw, data, path in drawings if draw(data, path)]
    if not written:
        raise ValueError(f"nothing to plot in {', '.join(map(str, paths))}: no known metric keys and no evaluations")
    return written


@exit_on_bad_input(2)
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directories", nargs="+", help="run directories (metrics.jsonl, eval.json's held-out "
                        "before/after) and/or launch.eval output directories (metrics.json)")
    parser.add_argument("--out", default=None, help="output directory (default: DIR/plots for one DIR, else ./plots)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else (Path(args.directories[0]) / "plots" if len(args.directories) == 1
                                           else Path("plots"))
    for path in plot_runs(args.directories, out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
