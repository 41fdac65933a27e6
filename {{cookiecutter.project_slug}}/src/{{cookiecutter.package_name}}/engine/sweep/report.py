"""What a sweep shows: summary.json and the table of trials, and the same search as a wandb sweep file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .. import PACKAGE
from ..ckpt.files import atomic_write
from .config import SearchSpace, SweepConfig

if TYPE_CHECKING:
    import optuna


def summary(study: optuna.Study, sweep: SweepConfig, metric: str) -> dict:
    """Every trial (state, value, values sampled, directory, wall time) and the best one."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    resumed_as = {t.user_attrs["resumes"]: t.number for t in trials if "resumes" in t.user_attrs}
    rows = []
    for t in trials:
        note = t.user_attrs.get("error", "")
        if t.number in resumed_as:
            note = f"interrupted; resumed as trial {resumed_as[t.number]}"
        elif "resumes" in t.user_attrs:
            note = f"resumes trial {t.user_attrs['resumes']}"
        rows.append(
            {
                "trial": t.number,
                "state": t.state.name,
                "value": t.value,
                "params": t.params,
                "output_dir": t.user_attrs.get("output_dir"),
                "wall_s": t.user_attrs.get("wall_s"),
                "note": note,
            }
        )
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = study.best_trial if complete else None
    return {
        "study": sweep.study,
        "metric": metric,
        "direction": study.direction.name.lower(),
        "trials": rows,
        "best": next(row for row in rows if row["trial"] == best.number) if best else None,
    }


def print_summary(result: dict, space: dict[str, SearchSpace]) -> None:
    """The trials as a table, then the best one with the commands that evaluate and export it."""
    metric = result["metric"]
    header = ["trial", "state", metric, *space, "wall_s", "note"]
    table = [header]
    for row in result["trials"]:
        params = [_short(row["params"].get(key)) for key in space]
        cells = [str(row["trial"]), row["state"], _short(row["value"]), *params, _short(row["wall_s"]), row["note"]]
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
    best = result["best"]
    if best:
        where = best["output_dir"]
        print(f"best: trial {best['trial']}, {metric}={best['value']:.6g}, in {where} (best.safetensors, best.json)")
        print(f"  python -m {PACKAGE}.evaluate run.output_dir={where}")
        print(f"  python -m {PACKAGE}.export run.output_dir={where}", flush=True)


def _short(value: Any) -> str:
    """A table cell: 4 significant digits, - for nothing."""
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_summary(result: dict, output_dir: Path) -> None:
    """output_dir/summary.json, replaced whole after every trial."""
    text = json.dumps(result, indent=1, allow_nan=False, default=str) + "\n"
    atomic_write(output_dir / "summary.json", lambda tmp: tmp.write_text(text, encoding="utf-8"))


def wandb_sweep(sweep: SweepConfig, metric: str, direction: str) -> dict:
    """The same search as a wandb sweep configuration, for `wandb sweep FILE` and `wandb agent`.

    wandb's agent sets WANDB_RUN_ID in each run's environment (after it has filled in the command),
    so the run's directory is named by OmegaConf's env resolver, which the training config resolves.
    """
    parameters = {}
    for key, space in sweep.params.items():
        if space.type == "categorical":
            parameters[key] = {"values": list(space.choices)}
        elif space.type == "float":
            kind = "log_uniform_values" if space.log else "q_uniform" if space.step else "uniform"
            parameters[key] = {"distribution": kind, "min": space.low, "max": space.high}
            if space.step:
                parameters[key]["q"] = space.step
        elif space.log:  # an integer q makes wandb return integers
            parameters[key] = {"distribution": "q_log_uniform_values", "min": int(space.low), "max": int(space.high)}
            parameters[key]["q"] = 1
        elif space.step and space.step != 1:  # exactly Optuna's grid low, low + step, ...
            parameters[key] = {"values": list(range(int(space.low), int(space.high) + 1, int(space.step)))}
        else:
            parameters[key] = {"distribution": "int_uniform", "min": int(space.low), "max": int(space.high)}
    run_dir = f"{sweep.output_dir}/wandb-runs/" + "${oc.env:WANDB_RUN_ID}"
    command = ["${env}", "${interpreter}", "-m", f"{PACKAGE}.train"]
    command += [item for f in sweep.config for item in ("--config", f)]
    command += [*sweep.overrides, "tracker.name=wandb", f"run.output_dir={run_dir}", "${args_no_hyphens}"]
    return {
        "name": sweep.study,
        "method": "bayes",
        "metric": {"name": metric, "goal": direction},
        "parameters": parameters,
        "command": command,
    }


def write_wandb_sweep(path: Path, config: dict) -> None:
    """The wandb sweep file, with a comment saying how to start it."""
    header = f"# wandb sweep {path}, then wandb agent with the sweep id it prints (made by {PACKAGE}.sweep)\n"
    text = header + yaml.safe_dump(config, sort_keys=False)
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    print(f"wrote {path}; start it with `wandb sweep {path}`, then `wandb agent` with the sweep id it prints")
