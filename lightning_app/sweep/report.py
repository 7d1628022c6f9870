"""The sweep's results, written into its folder whenever a sweep process ends: trials.md (every trial: parameters,
objective, state, run folder), sweep.png (optimisation history and parameter importances, matplotlib) and
best.yaml (the best trial's settings as a config: `python main.py fit --config <the sweep's configs> --config
best.yaml` trains it again)."""
from __future__ import annotations

import contextlib
import math
import shlex
import warnings
from pathlib import Path
from typing import Any

import yaml

from lightning_app.sweep import storage
from lightning_app.sweep.runner import flag_value
from lightning_app.sweep.space import Space, as_config

TABLE, FIGURE, BEST = "trials.md", "sweep.png", "best.yaml"


def _value(trial) -> float | None:
    if trial.value is not None:
        return float(trial.value)
    values = trial.intermediate_values  # a pruned or failed trial: its last report
    return float(values[max(values)]) if values else None


def table(study, space: Space, root: Path | None = None) -> str:
    trials = study.get_trials(deepcopy=False)
    keys = list(space.parameters)
    head = ["trial", *keys, space.objective, "epochs", "state", "run folder"]
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join(["--:"] * (1 + len(keys) + 2) + [":--", ":--"]) + "|"]
    best = _best(study)
    for t in trials:
        value = _value(t)
        run = t.user_attrs.get(storage.RUN_DIR, "")
        if run and root is not None:
            with contextlib.suppress(ValueError):
                run = str(Path(run).relative_to(root.resolve()))
        cells = [f"{t.number}{' (best)' if best is not None and t.number == best.number else ''}",
                 *(_fmt(t.params.get(k)) for k in keys), "" if value is None else f"{value:.4f}",
                 str(len(t.intermediate_values)), t.state.name.lower(),
                 f"`{run}`" if run else f"not run: repeats trial {t.user_attrs[storage.DUPLICATE_OF]}"
                 if storage.DUPLICATE_OF in t.user_attrs else ""]
        rows.append("| " + " | ".join(cells) + " |")
    counts = storage.count(study)
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return (f"Sweep {study.study_name}: {len(trials)} trials ({summary}); objective {space.objective}, "
            f"{space.direction}.\n\n" + "\n".join(rows) + "\n")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def _best(study):
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not done:
        return None
    pick = max if study.direction.name == "MAXIMIZE" else min
    return pick(done, key=lambda t: t.value)


def figure(study, space: Space, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.trial import TrialState

    fig, (history, importance) = plt.subplots(1, 2, figsize=(11, 4))
    trials = study.get_trials(deepcopy=False)
    maximize = study.direction.name == "MAXIMIZE"
    for state, marker, label in ((TrialState.COMPLETE, "o", "complete"), (TrialState.PRUNED, "x", "pruned (last)"),
                                 (TrialState.FAIL, "v", "failed (last)")):
        points = [(t.number, _value(t)) for t in trials if t.state == state and _value(t) is not None]
        if points:
            history.scatter(*zip(*points, strict=True), marker=marker, label=label)
    running, xs, ys = None, [], []
    for t in trials:
        if t.state == TrialState.COMPLETE:
            running = t.value if running is None else (max if maximize else min)(running, t.value)
        if running is not None:
            xs.append(t.number)
            ys.append(running)
    if xs:
        history.step(xs, ys, where="post", color="k", label="best so far")
    history.set(title="Optimisation history", xlabel="trial", ylabel=space.objective)
    if history.get_legend_handles_labels()[0]:
        history.legend(fontsize="small")
    try:
        import optuna

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scores = optuna.importance.get_param_importances(study)
        names = list(scores)[::-1]
        importance.barh(names, [scores[n] for n in names])
        importance.set(title="Parameter importances (fANOVA)", xlabel=f"importance for {space.objective}")
    except (ValueError, RuntimeError) as error:  # fewer than two complete trials, or one value for everything
        importance.text(0.5, 0.5, f"no importances yet:\n{error}", ha="center", va="center", wrap=True,
                        fontsize="small")
        importance.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def pass_through(base_args: list[str]) -> tuple[list[str], dict[str, Any]]:
    """(the --config files, every other `--section.key value` flag as {key: value}) of the sweep's command."""
    configs, flags, i = [], {}, 0
    while i < len(base_args):
        word = base_args[i]
        key, eq, value = word[2:].partition("=")
        if not eq:
            value, i = (base_args[i + 1] if i + 1 < len(base_args) else ""), i + 1
        if key == "config":
            configs.append(value)
        else:
            flags[key] = yaml.safe_load(value) if value else value
        i += 1
    return configs, flags


def best_config(study, space: Space, places: dict[str, tuple[str, ...]], base_args: list[str],
                path: Path = Path(BEST)) -> str | None:
    best = _best(study)
    if best is None:
        return None
    configs, flags = pass_through(base_args)
    doc = as_config({**flags, **best.params}, places)
    command = shlex.join(["python", "main.py", "fit", *(w for c in configs for w in ("--config", c)), "--config",
                          str(path)])
    head = (f"# Sweep {study.study_name}, trial {best.number}: {space.objective} {best.value:.4f} "
            f"({space.direction}).\n"
            f"# Its settings: the space's values and every flag the sweep passed to its trials. Train it again:\n"
            f"#   {command}\n")
    return head + yaml.safe_dump(doc, sort_keys=False)


def write(study, folder: Path, space: Space, places: dict[str, tuple[str, ...]], base_args: list[str],
          root: Path | None = None) -> list[Path]:
    written = [folder / TABLE]
    (folder / TABLE).write_text(table(study, space, root))
    figure(study, space, folder / FIGURE)
    written.append(folder / FIGURE)
    best = best_config(study, space, places, study.user_attrs.get(storage.FIXED, base_args), folder / BEST)
    if best is not None:
        (folder / BEST).write_text(best)
        written.append(folder / BEST)
    return written


def best_line(study, space: Space) -> str:
    best = _best(study)
    if best is None:
        return "no trial completed"
    params = ", ".join(f"{k}={flag_value(v)}" for k, v in best.params.items())
    value = best.value if best.value is not None and math.isfinite(best.value) else float("nan")
    line = f"best: trial {best.number}, {space.objective} {value:.4f} with {params}"
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    tied = [t for t in done if t.value == best.value]
    if len(tied) > 1 and len(tied) == len(done):
        line += (f" (every trial tied at {value:.4f}: in these epochs the space's values made no difference, and trial "
                 f"{best.number} is only the first; give the trials more epochs or data)")
    elif len(tied) > 1:
        line += f" ({len(tied)} trials tied at {value:.4f}; trial {best.number} is the first of them)"
    return line
