"""Many processes: process groups, DDP/FSDP2/HSDP wrapping, meta-device init, activation checkpointing."""
