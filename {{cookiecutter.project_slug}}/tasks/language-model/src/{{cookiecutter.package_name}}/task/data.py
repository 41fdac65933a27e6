"""Token data: a synthetic Markov source with a known entropy rate (default) or the token files
`PACKAGE.prepare` writes; training windows and exact validation windows over them.

Training reads windows of data.seq_len + 1 tokens. The sampler (loaders.ResumableSampler) shuffles
the window indices of an epoch by (seed, epoch) across all processes, and each epoch shifts every
window by an offset drawn from (seed, epoch): which tokens a sample holds depends on (seed, epoch,
index) only, so a resumed run reads exactly what an uninterrupted one would, and the token stream
is the same for any number of processes. Validation cuts the validation split into consecutive
windows so that every token after the first is predicted exactly once.

Conversations (`prepare --chat`) are packed instead: whole conversations, first-fit in an order
drawn from run.seed, into sequences of data.seq_len positions (Packs); each item holds the inputs,
the targets (IGNORE where the mask does not train them, and after a sequence's last document), and
each position's document number, from which the model restarts positions and keeps attention
within a document. A conversation longer than data.seq_len + 1 tokens is left out, and counted.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..engine.errors import DataError
from .config import DataConfig
from .tokenizer import AlphabetTokenizer, ByteTokenizer, HFTokenizer

DATA_SEED = 0  # the synthetic source does not change with run.seed: runs with other seeds see the same text
IGNORE = -100  # a target that is not counted (cross_entropy's ignore_index)


class MarkovSource:
    """Text from a random Markov chain of order k over V symbols, with its entropy rate.

    Each symbol s has a next-symbol distribution Q_s ~ Dirichlet(concentration); each context (the
    previous k symbols, ending in s) has its own distribution drawn around it,
    Dirichlet(context_concentration x V x Q_s). So the last symbol alone predicts much (a model
    learns that first), and the symbols before it refine the prediction (which takes attention).
    The entropy rate H = sum over contexts of stationary(context) x entropy(next | context) is
    the lowest mean cross-entropy per token any model can reach on the chain's text: the floor a
    trained model's val/loss approaches.
    """

    def __init__(
        self, vocab_size: int, order: int, concentration: float, context_concentration: float, seed: int = DATA_SEED
    ):
        self.vocab_size, self.order = vocab_size, order
        self.contexts = vocab_size**order
        rng = np.random.default_rng(seed)
        by_last = rng.dirichlet(np.full(vocab_size, concentration), size=vocab_size)
        around = context_concentration * vocab_size * by_last[np.arange(self.contexts) % vocab_size] + 1e-3
        self.next_probs = np.stack([rng.dirichlet(alpha) for alpha in around])
        self.stationary = self._stationary()

    def _successors(self) -> np.ndarray:
        """successors[c, x]: the context after symbol x follows context c."""
        return (np.arange(self.contexts)[:, None] * self.vocab_size) % self.contexts + np.arange(self.vocab_size)

    def _stationary(self, iterations: int = 10_000) -> np.ndarray:
        successors, pi = self._successors().ravel(), np.full(self.contexts, 1.0 / self.contexts)
        for _ in range(iterations):
            flow = (pi[:, None] * self.next_probs).ravel()
            new = np.bincount(successors, weights=flow, minlength=self.contexts)
            if np.abs(new - pi).sum() < 1e-13:
                return new
            pi = new
        return pi

    def entropy_rate(self) -> float:
        """Nats per token: the lowest achievable mean cross-entropy on this source's text."""
        p = self.next_probs
        per_context = -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=1)
        return float(self.stationary @ per_context)

    def sample(self, tokens: int, streams: int, seed: int) -> np.ndarray:
        """`tokens` symbols as `streams` independent runs of the chain, each started from the
        stationary distribution, one after the other."""
        rng = np.random.default_rng(seed)
        length = math.ceil(tokens / streams)
        cumulative = self.next_probs.cumsum(axis=1)
        context = rng.choice(self.contexts, size=streams, p=self.stationary)
        out = np.empty((streams, length), dtype=np.uint8)
        for t in range(length):
            draws = rng.random(streams)
            symbols = (draws[:, None] > cumulative[context]).sum(axis=1).clip(max=self.vocab_size - 1)
            out[:, t] = symbols
            context = (context * self.vocab_size) % self.contexts + symbols
        return out.reshape(-1)[:tokens]


class Tokens:
    """A 1-D token array: in memory, or the token files of one split (prepare's shards) read as one
    stream, each file mapped on first use in each process (workers too)."""

    def __init__(self, array: np.ndarray | None = None, paths: list[Path] = (), dtype: str = "uint16"):
        self.array, self.paths, self.dtype = array, list(paths), dtype
        self.parts: list[np.ndarray] | None = None
        if array is not None:
            self.starts = np.array([0, len(array)])
        else:
            sizes = [path.stat().st_size // np.dtype(dtype).itemsize for path in self.paths]
            self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def __getstate__(self):  # a worker maps the files itself instead of receiving a copy of them
        state = dict(self.__dict__)
        if self.paths:
            state["parts"] = None
        return state

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _mapped(self) -> list[np.ndarray]:
        if self.parts is None:
            self.parts = (
                [self.array]
                if self.array is not None
                else [np.memmap(p, dtype=self.dtype, mode="r") for p in self.paths]
            )
        return self.parts

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream (a view when they lie in one file, else a copy)."""
        parts, first = self._mapped(), int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        for index in range(first, len(parts)):
            offset = int(self.starts[index])
            if offset >= stop:
                break
            pieces.append(parts[index][max(start - offset, 0) : stop - offset])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def window(self, start: int, length: int) -> torch.Tensor:
        return torch.from_numpy(self.read(start, start + length).astype(np.int64))


class TrainWindows(Dataset):
    """Windows of seq_len + 1 tokens, taken by the (epoch, index) keys of loaders.ResumableSampler.

    Window i of an epoch starts at i x seq_len + offset(seed, epoch), so each epoch reads every
    token once, cut at other places than the epoch before.
    """

    def __init__(self, tokens: Tokens, seq_len: int, seed: int):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.count = (len(tokens) - 1) // seq_len - 1
        if self.count < 1:
            raise DataError(
                f"the training split has {len(tokens)} tokens, too few for windows of data.seq_len={seq_len}"
            )

    def __len__(self) -> int:
        return self.count

    def offset(self, epoch: int) -> int:
        return random.Random(self.seed * 1_000_003 + epoch).randrange(self.seq_len)

    def __getitem__(self, key: tuple[int, int]) -> torch.Tensor:
        epoch, index = key
        return self.tokens.window(index * self.seq_len + self.offset(epoch), self.seq_len + 1)


class ValWindows(Dataset):
    """Consecutive windows over the validation split; the last one ends at the split's end and does
    not count the targets its predecessor counted. Items: (window of seq_len + 1 tokens, the number
    of its leading targets not counted)."""

    def __init__(self, tokens: Tokens, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"the validation split has {len(tokens)} tokens, fewer than data.seq_len + 1 = {seq_len + 1}"
            )
        self.targets = len(tokens) - 1  # every token but the first is predicted once
        self.count = math.ceil(self.targets / seq_len)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        start = min(index * self.seq_len, self.targets - self.seq_len)
        return self.tokens.window(start, self.seq_len + 1), index * self.seq_len - start


class DeviceWindows:
    """TrainWindows or ValWindows with their split on the training device as one int32 tensor
    (data.loader=device): batch(epoch, indices) gathers the same windows, as int64 token ids, there.
    Training windows (an epoch given) start where TrainWindows' do; validation windows (epoch None)
    come with their number of leading targets not counted, as ValWindows' do."""

    CHUNK = 1 << 26  # tokens copied at a time: a file's tokens never all sit in RAM as int32 at once

    def __init__(self, windows: TrainWindows | ValWindows, device: torch.device):
        self.windows, self.device, self.seq_len = windows, device, windows.seq_len
        tokens = windows.tokens
        self.tokens = torch.empty(len(tokens), dtype=torch.int32, device=device)
        for start in range(0, len(tokens), self.CHUNK):
            chunk = torch.from_numpy(tokens.read(start, start + self.CHUNK).astype(np.int32))
            self.tokens[start : start + len(chunk)].copy_(chunk)
        self.span = torch.arange(self.seq_len + 1, device=device)

    def __len__(self) -> int:
        return len(self.windows)

    def batch(self, epoch: int | None, indices: torch.Tensor):
        starts = indices * self.seq_len
        if epoch is not None:
            return self.tokens[(starts + self.windows.offset(epoch))[:, None] + self.span].long()
        clamped = starts.clamp(max=self.windows.targets - self.seq_len)
        return self.tokens[clamped[:, None] + self.span].long(), starts - clamped


def first_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Items (their indices, in the order given) packed first-fit into bins of `capacity`: each item goes into
    the first bin with room for it, found in a segment tree of the bins' room (log time per item)."""
    size = 1 << max(len(lengths) - 1, 0).bit_length()
    room = np.full(2 * size, capacity, dtype=np.int64)  # leaf size + b: bin b's room; a node: its children's most
    bins: list[list[int]] = []
    for item, length in enumerate(lengths.tolist()):
        node = 1
        while node < size:
            node = 2 * node if room[2 * node] >= length else 2 * node + 1
        index = node - size
        if index == len(bins):
            bins.append([])
        bins[index].append(item)
        room[node] -= length
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


class Packs(Dataset):
    """Conversations packed whole into sequences of seq_len positions, first-fit in an order drawn from seed
    (validation: in file order, seed None). Item: int64 [3, seq_len], the inputs, the targets (IGNORE where
    not trained) and each position's document number (the positions after the last document are one more
    document, all IGNORE). Training takes the (epoch, index) keys of the sampler, validation indices."""

    def __init__(self, tokens: Tokens, trained: Tokens, ends: np.ndarray, seq_len: int, seed: int | None):
        self.tokens, self.trained, self.seq_len = tokens, trained, seq_len
        self.starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self.ends = ends.astype(np.int64)
        positions = self.ends - self.starts - 1  # a conversation of n tokens fills n - 1 positions
        fits = (positions >= 1) & (positions <= seq_len)
        self.left_out = int((positions > seq_len).sum())
        order = np.flatnonzero(fits)
        if seed is not None:
            order = np.random.default_rng(seed).permutation(order)
        self.packs = [order[bin_] for bin_ in first_fit(positions[order], seq_len)]
        if not self.packs:
            raise DataError(
                f"no conversation fits data.seq_len={seq_len} (+1): {self.left_out} are longer; raise data.seq_len"
            )

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, key) -> torch.Tensor:
        index = key[1] if isinstance(key, tuple) else key
        item = np.zeros((3, self.seq_len), dtype=np.int64)
        item[1] = IGNORE
        done = 0
        for number, document in enumerate(self.packs[index]):
            start, end = self.starts[document], self.ends[document]
            ids = self.tokens.read(start, end).astype(np.int64)
            trained = self.trained.read(start + 1, end).astype(bool)
            length = end - start - 1
            item[0, done : done + length] = ids[:-1]
            item[1, done : done + length] = np.where(trained, ids[1:], IGNORE)
            item[2, done : done + length] = number
            done += length
        item[2, done:] = len(self.packs[index])
        return torch.from_numpy(item)


@dataclass
class TokenData:
    """What the model and the metrics need to know about the data."""

    vocab_size: int
    bytes_per_token: float  # of the validation split's text: turns nats per token into bits per byte
    loss_floor: float | None  # the synthetic source's entropy rate; None for real text
    tokenizer: object
    chat: dict | None = None  # meta.json's chat entry for prepare --chat data


def build_datasets(cfg: DataConfig, seed: int) -> tuple[TrainWindows | Packs, ValWindows | Packs, TokenData]:
    """The training windows (by (epoch, index) keys), the validation windows, and what they hold; for
    prepare --chat data, packed conversations."""
    if cfg.name == "synthetic":
        source = MarkovSource(cfg.vocab_size, cfg.order, cfg.concentration, cfg.context_concentration)
        train = Tokens(source.sample(cfg.train_tokens, streams=64, seed=DATA_SEED + 1))
        val = Tokens(source.sample(cfg.val_tokens, streams=16, seed=DATA_SEED + 2))
        info = TokenData(cfg.vocab_size, 1.0, source.entropy_rate(), AlphabetTokenizer(cfg.vocab_size))
    else:
        root = Path(cfg.root)
        meta = read_meta(root)
        train, val = (
            Tokens(paths=[root / name for name in meta[split]["files"]], dtype=meta["dtype"])
            for split in ("train", "val")
        )
        for split, tokens in (("train", train), ("val", val)):
            if len(tokens) != meta[split]["tokens"]:
                raise DataError(
                    f"data.root={cfg.root!r}: the {split} files hold {len(tokens)} tokens, meta.json says "
                    f"{meta[split]['tokens']}; run prepare again"
                )
        tokenizer = ByteTokenizer() if meta["tokenizer"] == "bytes" else HFTokenizer(root / meta["tokenizer"])
        bytes_per_token = meta["val"]["bytes"] / max(meta["val"]["tokens"], 1)
        info = TokenData(meta["vocab_size"], bytes_per_token, None, tokenizer, meta.get("chat"))
        if info.chat is not None:
            train_set, val_set = (
                Packs(tokens, _masks(root, meta, split), _ends(root, meta, split), cfg.seq_len, split_seed)
                for split, tokens, split_seed in (("train", train, seed), ("val", val, None))
            )
            return train_set, val_set, info
    return TrainWindows(train, cfg.seq_len, seed), ValWindows(val, cfg.seq_len), info


def _masks(root: Path, meta: dict, split: str) -> Tokens:
    masks = Tokens(paths=[root / name for name in meta[split]["mask_files"]], dtype="uint8")
    if len(masks) != meta[split]["tokens"]:
        raise DataError(
            f"data.root={str(root)!r}: the {split} mask files do not match its token files; run prepare again"
        )
    return masks


def _ends(root: Path, meta: dict, split: str) -> np.ndarray:
    ends = np.fromfile(root / meta[split]["ends"], dtype=np.int64)
    if len(ends) != meta[split]["documents"] or (len(ends) and ends[-1] != meta[split]["tokens"]):
        raise DataError(f"data.root={str(root)!r}: {meta[split]['ends']} does not match meta.json; run prepare again")
    return ends


META_KEYS = ("format", "tokenizer", "vocab_size", "dtype", "train", "val")


def read_meta(root: Path) -> dict:
    """meta.json of a prepared data directory, checked enough that training cannot misread it."""
    path = root / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(f"data.root={str(root)!r}: cannot read meta.json ({err}); run prepare again") from None
    missing = [key for key in META_KEYS if key not in meta] if isinstance(meta, dict) else list(META_KEYS)
    if missing:
        raise DataError(f"{path}: missing {', '.join(missing)}; it was not written by prepare, run prepare again")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"{path}: dtype {meta['dtype']!r} is not uint16 or uint32")
    for split in ("train", "val"):  # format 1 (one file per split) names no files
        files = meta[split].setdefault("files", [f"{split}.bin"]) if isinstance(meta[split], dict) else None
        if not isinstance(files, list) or not all(isinstance(f, str) and "/" not in f for f in files):
            raise DataError(f"{path}: {split}.files must be a list of file names in data.root")
        if "chat" in meta:  # prepare --chat: the masks and where each conversation ends
            files = [*files, *meta[split].get("mask_files", []), meta[split].get("ends", f"{split}_ends.bin")]
        missing = [name for name in files if not (root / name).is_file()]
        if missing:
            raise DataError(f"data.root={str(root)!r}: {missing[0]} is missing; run prepare again")
    return meta
