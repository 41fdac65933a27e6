"""Training with PyTorch. task/ is what this project trains, engine/ how; the commands are
python -m <package>.train, .evaluate, .export, .plot and .sweep."""

from .engine import startup  # noqa: F401  (first, before anything imports torch: see its docstring)

__version__ = "0.1.0"
