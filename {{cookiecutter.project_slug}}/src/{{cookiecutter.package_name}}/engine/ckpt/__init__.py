"""Checkpoints: atomic files, the full and sharded formats, and restoring a trained model."""
