"""The generated project's training loader at 224x224: worker CPU per sample, and images/s.

    python bench/loader.py --package my_trainer --handoff uint8 --batches 20

What a GPU run waits on when the model is fast: the default pipeline (synthetic images, random
crop and flip, seeded per sample) at 224x224, batch 64. Two hand-offs:

- uint8: the project's pipeline. Workers return uint8 images; the consumer turns each batch into
  normalised float32 with the project's DeviceImages (on a GPU run, on the GPU).
- float: the common idiom the project replaced. Workers append ToDtype + Normalize to every
  sample and hand over float32, four times the bytes.

Prints JSON with two figures:
- worker_ms_per_sample: the CPU one worker spends per sample (fetch, transforms, collation),
  measured in this process on one thread. This bounds what N workers can feed a GPU.
- images_per_s: normalised float32 batches through a DataLoader with 2 workers, the consumer
  normalising uint8 batches on this CPU (so that cost counts here; on a GPU it would not), over
  the batches after the first two (worker start-up is left out).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import time
from dataclasses import replace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="my_trainer")
    parser.add_argument("--handoff", choices=["uint8", "float"], required=True)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()

    import torch
    from torchvision.transforms import v2

    data = importlib.import_module(f"{args.package}.task.data")
    loaders = importlib.import_module(f"{args.package}.engine.loaders")
    config = importlib.import_module(f"{args.package}.task.config")
    batch = 64
    cfg = config.DataConfig(
        image_size=224, batch_size=batch, num_workers=2, train_size=batch * (args.batches + 2)
    )
    if args.handoff == "float":
        project_transforms = data.build_transforms

        def float_transforms(cfg, train):
            mean, std = data.MEAN_STD[cfg.name]
            steps = project_transforms(cfg, train).transforms
            steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
            return v2.Compose(steps)

        data.build_transforms = float_transforms
    train_set, _, _ = data.build_datasets(cfg)
    # The training set takes (epoch, index) keys.
    train_set = data.SeededAugmentation(train_set, seed=0)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker
    in_process = loaders.build_train_loader(replace(cfg, num_workers=0), train_set, seed=0)
    in_process.sampler.set_position(0, 0)
    batches = iter(in_process)
    next(batches)  # first-call costs
    started = time.process_time()
    samples = sum(len(targets) for _, targets in itertools.islice(batches, args.batches))
    worker_ms = 1000 * (time.process_time() - started) / samples
    torch.set_num_threads(threads)

    loader = loaders.build_train_loader(cfg, train_set, seed=0)
    inputs = data.DeviceImages(torch.device("cpu"), cfg.name)
    loader.sampler.set_position(0, 0)
    images_seen = 0
    for index, (images, targets) in enumerate(loader):
        images = inputs(images)  # uint8: normalised here; float: moved unchanged
        assert images.dtype == torch.float32
        if index == 1:
            started = time.perf_counter()
        elif index > 1:
            images_seen += len(targets)
    elapsed = time.perf_counter() - started
    loaders.shut_down_workers(loader)
    result = {"worker_ms_per_sample": worker_ms, "images_per_s": images_seen / elapsed}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
