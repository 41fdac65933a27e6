"""Token data: the synthetic source's floor, windows by (seed, epoch, index), exact validation
windows for any number of processes, and the prepare command."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from {{ cookiecutter.package_name }}.engine.loaders import ResumableSampler, build_train_loader, build_val_loader
from {{ cookiecutter.package_name }}.prepare import main as prepare_main
from {{ cookiecutter.package_name }}.task.config import DataConfig
from {{ cookiecutter.package_name }}.task.data import IGNORE, MarkovSource, Tokens, TrainWindows, ValWindows, build_datasets
from {{ cookiecutter.package_name }}.task.prepare import goes_to_val
from {{ cookiecutter.package_name }}.train import main as train_main


def test_entropy_rate_is_the_cross_entropy_of_the_true_chain():
    """The logged floor is the source's entropy rate: the true chain's own mean cross-entropy on a
    long sample of its text equals it (to sampling noise), and it lies below what the last symbol
    alone predicts."""
    source = MarkovSource(vocab_size=8, order=2, concentration=0.3, context_concentration=0.5, seed=3)
    text = source.sample(400_000, streams=16, seed=4).astype(np.int64).reshape(16, -1)
    contexts = text[:, :-2] * 8 + text[:, 1:-1]
    empirical = -np.log(source.next_probs[contexts, text[:, 2:]]).mean()
    assert empirical == pytest.approx(source.entropy_rate(), rel=0.01)
    pairs = np.zeros((8, 8))
    np.add.at(pairs, (text[:, 1:-1].ravel(), text[:, 2:].ravel()), 1)
    by_last = pairs / pairs.sum(axis=1, keepdims=True)
    bigram = -(pairs / pairs.sum() * np.log(np.where(by_last > 0, by_last, 1))).sum()
    assert bigram > source.entropy_rate() * 1.02


def test_synthetic_data_is_the_same_for_every_run_seed():
    """The source's text does not change with run.seed (it is the data, not the run)."""
    cfg = DataConfig(train_tokens=5000, val_tokens=500, seq_len=16)
    a, b = build_datasets(cfg, seed=0), build_datasets(cfg, seed=7)
    assert np.array_equal(a[0].tokens.data, b[0].tokens.data) and np.array_equal(a[1].tokens.data, b[1].tokens.data)
    assert a[2].loss_floor == b[2].loss_floor and 0 < a[2].loss_floor < math.log(cfg.vocab_size)


def test_training_windows_depend_on_seed_epoch_and_index_only():
    """The same (epoch, index) is the same window; another epoch shifts the cut; windows are seq_len + 1
    consecutive tokens of the split."""
    tokens = Tokens(np.arange(1000, dtype=np.uint16))
    windows = TrainWindows(tokens, seq_len=10, seed=0)
    assert len(windows) == 98
    first = windows[(0, 5)]
    assert torch.equal(first, TrainWindows(tokens, 10, seed=0)[(0, 5)])
    assert torch.equal(first, torch.arange(first[0], first[0] + 11))
    offsets = {TrainWindows(tokens, 10, seed=0).offset(epoch) for epoch in range(20)}
    assert len(offsets) > 3 and all(0 <= o < 10 for o in offsets)
    assert all(windows[(e, len(windows) - 1)][-1] < 1000 for e in range(20))  # the last window fits every epoch


def test_the_token_stream_does_not_depend_on_the_number_of_processes():
    """Two processes' micro-batches, interleaved, are the one process's batch of twice the size."""
    cfg = DataConfig(batch_size=4, num_workers=0)
    windows = TrainWindows(Tokens(np.arange(2000, dtype=np.uint16)), seq_len=8, seed=3)
    one = next(iter(build_train_loader(DataConfig(batch_size=8), windows, seed=3)))
    two = [next(iter(build_train_loader(cfg, windows, seed=3, rank=r, world_size=2))) for r in (0, 1)]
    assert sorted(map(tuple, one.tolist())) == sorted(map(tuple, torch.cat(two).tolist()))


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_validation_counts_every_target_once_for_any_world_size(world_size):
    """The validation windows of all processes together predict each token after the first exactly once."""
    n, seq_len = 1000, 16
    val = ValWindows(Tokens(np.arange(n, dtype=np.uint32)), seq_len)
    counted = []
    for rank in range(world_size):
        for windows, skip in build_val_loader(DataConfig(batch_size=5), val, rank=rank, world_size=world_size):
            targets = windows[:, 1:].clone()
            targets[torch.arange(seq_len) < skip[:, None]] = IGNORE
            counted += targets[targets != IGNORE].tolist()
    assert sorted(counted) == list(range(1, n))


def test_sampler_resumes_mid_epoch():
    """Starting part-way into an epoch yields exactly the rest of that epoch's keys."""
    full, part = ResumableSampler(range(50), seed=3), ResumableSampler(range(50), seed=3)
    full.set_position(2, 0)
    part.set_position(2, 20)
    assert list(part) == list(full)[20:]


@pytest.fixture
def corpus(tmp_path):
    """A folder of 40 small text files, a hidden one, and a binary one."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for i in range(40):
        (root / ("sub" if i % 2 else "") / f"doc{i}.txt").write_text(f"document {i}: " + "héllo wörld " * (i + 1))
    (root / ".hidden.txt").write_text("never read")
    (root / "blob.bin").write_bytes(bytes([0xFF, 0xFE, 0x00, 0x81]))
    return root


def test_prepare_splits_by_document_and_counts_tokens_and_bytes(corpus, tmp_path, capsys):
    """Byte tokens of every UTF-8 file, one end-of-document token each, split by the hash of the
    file's relative name: the same split when the files are found in another order or place."""
    out = tmp_path / "tokens"
    assert prepare_main(["--out", str(out), "--val-fraction", "0.2", str(corpus)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"], meta["skipped_files"]) == ("bytes", 257, "uint16", 1)
    names = [p.relative_to(corpus).as_posix() for p in corpus.rglob("*.txt") if not p.name.startswith(".")]
    in_val = [n for n in names if goes_to_val(n, 0.2)]
    assert meta["val"]["documents"] == len(in_val) > 0 and meta["train"]["documents"] == 40 - len(in_val)
    val_bytes = sum(len((corpus / n).read_bytes()) for n in in_val)
    assert meta["val"]["bytes"] == val_bytes and meta["val"]["tokens"] == val_bytes + len(in_val)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert len(val) == meta["val"]["tokens"] and (val == 256).sum() == len(in_val)
    assert "1 files skipped" in capsys.readouterr().out

    again = tmp_path / "again"
    assert prepare_main(["--out", str(again), "--val-fraction", "0.2", str(corpus)]) == 0
    assert (again / "val.bin").read_bytes() == (out / "val.bin").read_bytes()
    assert prepare_main(["--out", str(out), str(corpus)]) == 2  # never overwrites


def test_prepare_reads_only_the_files_glob_names(corpus, tmp_path):
    """--glob '*.txt' reads the 40 text documents and never opens the binary file."""
    out = tmp_path / "tokens"
    assert prepare_main(["--out", str(out), "--glob", "*.txt", str(corpus)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train"]["documents"] + meta["val"]["documents"] == 40 and meta["skipped_files"] == 0


def test_training_on_prepared_text_reports_bits_per_byte(corpus, tmp_path, run_dir):
    """data.name=text trains on the token files; val/bpb = val/loss / ln 2 x tokens / bytes of the split."""
    out = tmp_path / "tokens"
    assert prepare_main(["--out", str(out), "--val-fraction", "0.3", str(corpus)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    overrides = ["run.device=cpu", "tracker.name=none", f"run.output_dir={run_dir}", "data.name=text",
                 f"data.root={out}", "data.seq_len=16", "data.batch_size=4", "model.preset=nano",
                 "trainer.max_steps=3", "trainer.val_every=null"]  # fmt: skip
    assert train_main(overrides) == 0
    line = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines() if "val/bpb" in s][-1]
    assert line["val/tokens"] == meta["val"]["tokens"] - 1 and "val/loss_floor" not in line
    ratio = meta["val"]["tokens"] / meta["val"]["bytes"]
    assert line["val/bpb"] == pytest.approx(line["val/loss"] / math.log(2) * ratio, rel=1e-9)


def test_prepare_with_a_tokenizer_json(corpus, tmp_path, run_dir):
    """A local tokenizer.json (here a word-level one trained on the corpus) tokenizes the files, is
    copied beside the token files, and training reads the vocabulary from it."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"])
    tokenizer.train([str(p) for p in corpus.rglob("*.txt")], trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "tokens"
    assert prepare_main(["--out", str(out), "--tokenizer", str(tmp_path / "tokenizer.json"), str(corpus)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "tokenizer.json" and (out / "tokenizer.json").is_file()
    assert meta["vocab_size"] == tokenizer.get_vocab_size() and meta["eot"] == tokenizer.token_to_id("<|endoftext|>")
    overrides = ["run.device=cpu", "tracker.name=none", f"run.output_dir={run_dir}", "data.name=text",
                 f"data.root={out}", "data.seq_len=8", "data.batch_size=4", "model.preset=nano",
                 "trainer.max_steps=2"]  # fmt: skip
    assert train_main(overrides) == 0
    assert latest_checkpoint_vocab(run_dir) == tokenizer.get_vocab_size()


def latest_checkpoint_vocab(run_dir) -> int:
    from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint

    return latest_checkpoint(run_dir / "checkpoints")[1]["model"]["tok_emb.weight"].shape[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--val-fraction", "1.5"], "--val-fraction=1.5 must be between 0 and 1"),
        (["--tokenizer", "missing.json"], "--tokenizer 'missing.json': no such file"),
        (["no/such/dir"], "no/such/dir: no such file or directory"),
    ],
)
def test_prepare_refuses_bad_input_with_one_line(corpus, tmp_path, arguments, message):
    paths = [] if arguments == ["no/such/dir"] else [str(corpus)]
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.prepare", "--out", str(tmp_path / "o"), *arguments, *paths]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_text_data_without_prepared_files_is_a_config_error(tmp_path, capsys):
    assert (
        train_main(["run.device=cpu", f"run.output_dir={tmp_path / 'r'}", "data.name=text", f"data.root={tmp_path}"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "meta.json" in err[0] and ".prepare --out" in err[0], err
