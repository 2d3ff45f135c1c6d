"""launch.plot: training curves and evaluation bars render into PNGs that are not blank; bad inputs name the path."""
import json

import numpy as np
import pytest
from matplotlib.image import imread

from launch import plot

# matplotlib's first two default line colours (tab:blue, tab:orange), as RGB in [0, 1]
BLUE, ORANGE = np.array([31, 119, 180]) / 255, np.array([255, 127, 14]) / 255


def write_run(directory, steps, *, with_kl, eval_json=None):
    directory.mkdir()
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "reward_mean": 0.1 * step, "format_rate": min(1.0, 0.2 * step),
                  "response_length_mean": 40.0 - step, "entropy": 1.5 / step, "lr": 1e-6}
        if with_kl:
            record["kl"] = "nan" if step == 1 else 0.01 * step  # the run log writes NaN as a string
        lines.append(json.dumps(record))
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if eval_json is not None:
        (directory / "eval.json").write_text(json.dumps(eval_json))
    return directory


def has_colour(image, colour, tolerance=0.03):
    """Fraction of pixels within `tolerance` of an RGB colour."""
    return float((np.abs(image[..., :3] - colour).max(axis=-1) < tolerance).mean())


def check_png(path):
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    non_white = (image[..., :3] < 0.95).any(axis=-1).mean()
    assert 0.01 < non_white < 0.9  # something drawn, on a mostly white background
    return image


def test_curves_and_bars_render(tmp_path, capsys):
    interval = lambda mean, low, high: {"mean": mean, "low": low, "high": high}  # noqa: E731
    held_out = {"before": {"count": 4, "means": {"acc": interval(0.25, 0.0, 0.5), "format": interval(0.5, 0.2, 0.8)}},
                "after": {"count": 4, "means": {"acc": interval(0.5, 0.2, 0.8), "format": interval(1.0, 1.0, 1.0)}}}
    first = write_run(tmp_path / "sft_then_grpo", 5, with_kl=True, eval_json=held_out)
    second = write_run(tmp_path / "grpo_only", 8, with_kl=False)
    evaluated = tmp_path / "eval_base"
    evaluated.mkdir()
    (evaluated / "metrics.json").write_text(json.dumps({"metrics": {
        "scifact_evidence": {"count": 4, "answer_accuracy": 0.75, "evidence_f1": 0.4},
        "verifier": {"count": 2, "accuracy": 0.5}}}))
    out = tmp_path / "plots"
    assert plot.main([str(first), str(second), str(evaluated), "--out", str(out)]) == 0
    assert capsys.readouterr().out.split() == [str(out / "training_curves.png"), str(out / "eval_comparison.png")]

    curves = check_png(out / "training_curves.png")
    # a line per run: both default colours appear
    assert has_colour(curves, BLUE) > 1e-4 and has_colour(curves, ORANGE) > 1e-4
    bars = check_png(out / "eval_comparison.png")
    assert has_colour(bars, BLUE) > 1e-3  # filled bars cover many pixels


def test_a_reward_without_a_format_component_gets_no_format_bar(tmp_path, monkeypatch):
    """On 5cd6fe9 a custom reward's held-out panel showed 'format success' as an empty bar labelled n/a."""
    import launch.plot
    drawn = []
    monkeypatch.setattr(launch.plot.Figure, "savefig", lambda figure, path, **_: drawn.append(figure))
    evaluations = {"run after": {"held-out (trainer)": {"acc": 0.5}}}
    assert launch.plot.evaluation_bars(evaluations, tmp_path / "bars.png") == ["held-out (trainer)"]
    assert [tick.get_text() for tick in drawn[0].axes[0].get_xticklabels()] == ["accuracy"]


def test_panels_follow_the_logged_keys(tmp_path):
    runs = {"a": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}],
            "b": [{"step": 1, "reward_mean": 0.2, "kl": 0.1}]}
    assert plot.training_curves(runs, tmp_path / "curves.png") == ["reward_mean", "kl", "loss"]
    check_png(tmp_path / "curves.png")
    assert plot.training_curves({"c": [{"step": 1, "lr": 1.0}]}, tmp_path / "none.png") == []
    assert not (tmp_path / "none.png").exists()
    evaluations = {"base": {"scifact_evidence": {"answer_accuracy": 0.3, "evidence_f1": 0.1}},
                   "tuned": {"scifact_evidence": {"answer_accuracy": 0.6}, "my_task": {"reward_mean": 2.5}}}
    assert plot.evaluation_bars(evaluations, tmp_path / "bars.png") == ["scifact_evidence", "my_task"]
    check_png(tmp_path / "bars.png")


def test_one_directory_defaults_to_its_plots_folder(tmp_path):
    run = write_run(tmp_path / "run", 3, with_kl=False)
    assert plot.main([str(run)]) == 0
    assert (run / "plots" / "training_curves.png").is_file() and not (run / "plots" / "eval_comparison.png").exists()


def test_bad_inputs_name_the_path(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert plot.main([str(empty), "--out", str(tmp_path / "out")]) == 2
    assert str(empty) in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n{"step": 2, "reward_mean": \n')
    assert plot.main([str(broken), "--out", str(tmp_path / "out")]) == 2
    assert f"{broken / 'metrics.jsonl'}:2" in capsys.readouterr().err
    assert plot.main([str(tmp_path / "absent")]) == 2
    assert str(tmp_path / "absent") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value, expected", [(0.5, 0.5), ("nan", None), ("inf", float("inf")), (None, None)])
def test_logged_values_become_floats(value, expected):
    number = plot._number(value)
    assert (np.isnan(number) if expected is None else number == expected)
