"""The hyperparameter search behind `python -m PACKAGE.sweep` (its docstring says what the command does).

config   the sweep file: its keys, their checks, and the training config loaded at every bound
study    the Optuna study in output_dir/journal.log, and the loop that runs trials until enough are done
trial    one trial: training as a child process, its validations reported as written, its outcome
report   summary.json, the table of trials, and the same search as a wandb sweep file
"""
