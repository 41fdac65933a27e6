"""Training with PyTorch. task/ is what this project trains, engine/ how; the commands are
python -m <package>.train, .evaluate, .export, .plot and .sweep."""

__version__ = "0.1.0"
