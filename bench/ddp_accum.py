"""Run the generated project's training under torchrun and count DDP gradient all-reduce rounds.

    torchrun --nproc_per_node=2 bench/ddp_accum.py [--sync-every-micro] -- OVERRIDES

A round is one all-reduce of every gradient bucket (counted where the last bucket goes out).
--sync-every-micro turns off the skipping (DDP's no_sync) so each micro-batch all-reduces, which
is what a loop without it pays. Rank 0 prints JSON: rounds per optimizer step and the
steady-state seconds per optimizer step (after --warmup steps).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="my_trainer")
    parser.add_argument("--sync-every-micro", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    distributed = importlib.import_module(f"{args.package}.engine.parallel.distributed")
    train = importlib.import_module(f"{args.package}.train")
    rounds, step_times = [], []
    wrap_model = distributed.wrap_model

    def counting_hook(state, bucket):
        rounds.append(bucket.is_last())
        return allreduce_hook(state, bucket)

    def wrap_and_count(model, dcfg, env):
        wrapped = wrap_model(model, dcfg, env)
        wrapped.register_comm_hook(None, counting_hook)
        return wrapped

    distributed.wrap_model = wrap_and_count
    if args.sync_every_micro:
        distributed.gradient_sync = lambda model, enabled: contextlib.nullcontext()
    register_optimizer_step_post_hook(lambda *_: step_times.append(time.perf_counter()))

    code = train.main(args.overrides)
    if code:
        sys.exit(code)
    if os.environ.get("RANK", "0") == "0":
        steps = len(step_times)
        timed = step_times[args.warmup - 1 :]
        print(
            json.dumps(
                {
                    "rounds_per_step": sum(rounds) / steps,
                    "step_s": (timed[-1] - timed[0]) / (len(timed) - 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
