"""Checkpoints: atomic files (files), the names in a checkpoints folder (names), the full and sharded formats
(checkpoint, sharded), and restoring a trained model (restore)."""
