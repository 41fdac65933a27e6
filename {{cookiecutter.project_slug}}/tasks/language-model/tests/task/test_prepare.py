"""The prepare command: the inputs people have (text files, one big file, JSON lines, Parquet, a
datasets folder), the split rules, shards read as one stream, --workers writing the same bytes as
one process, and memory that does not grow with the corpus."""

import gzip
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from {{ cookiecutter.package_name }}.prepare import main as prepare_main
from {{ cookiecutter.package_name }}.task.config import DataConfig
from {{ cookiecutter.package_name }}.task.data import build_datasets
from {{ cookiecutter.package_name }}.task.prepare import encode as prepare_encode
from {{ cookiecutter.package_name }}.task.prepare import goes_to_val
from {{ cookiecutter.package_name }}.task.prepare import pieces as prepare_pieces
from {{ cookiecutter.package_name }}.task.prepare import split as prepare_split
from {{ cookiecutter.package_name }}.train import main as train_main

DOCUMENTS = [f"document {i}: " + "héllo wörld, " * (i % 7 + 1) + "\nsecond line {i}" for i in range(30)]


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


def split_tokens(out, split: str) -> np.ndarray:
    """A split's tokens: its files, in meta.json's order, one after the other."""
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([np.fromfile(out / name, dtype=meta["dtype"]) for name in meta[split]["files"]])


def byte_tokens(documents: list[str]) -> np.ndarray:
    """The bytes tokenizer's ids of documents: each document's UTF-8 bytes, then the end token 256."""
    return np.concatenate(
        [np.append(np.frombuffer(doc.encode(), np.uint8).astype(np.uint16), 256) for doc in documents]
    )


def output_bytes(out) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.glob("*.bin"))}


def test_prepare_splits_by_document_and_counts_tokens_and_bytes(corpus, tmp_path, capsys):
    """Byte tokens of every UTF-8 file, one end-of-document token each, split by the hash of the
    file's relative name: the same split when the files are found in another order or place."""
    out = tmp_path / "tokens"
    assert prepare_main(["--out", str(out), "--val-fraction", "0.2", str(corpus)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"], meta["skipped_files"]) == ("bytes", 257, "uint16", 1)
    assert meta["split"] == {"rule": "hash", "val_fraction": 0.2} and meta["val"]["files"] == ["val_000000.bin"]
    names = [p.relative_to(corpus).as_posix() for p in corpus.rglob("*.txt") if not p.name.startswith(".")]
    in_val = [n for n in names if goes_to_val(n, 0.2)]
    assert meta["val"]["documents"] == len(in_val) > 0 and meta["train"]["documents"] == 40 - len(in_val)
    val_bytes = sum(len((corpus / n).read_bytes()) for n in in_val)
    assert meta["val"]["bytes"] == val_bytes and meta["val"]["tokens"] == val_bytes + len(in_val)
    val = split_tokens(out, "val")
    assert len(val) == meta["val"]["tokens"] and (val == 256).sum() == len(in_val)
    assert "1 files skipped" in capsys.readouterr().out

    again = tmp_path / "again"
    assert prepare_main(["--out", str(again), "--val-fraction", "0.2", str(corpus)]) == 0
    assert output_bytes(again) == output_bytes(out)
    assert prepare_main(["--out", str(out), str(corpus)]) == 2  # never overwrites


def test_prepare_reads_only_the_files_glob_names(corpus, tmp_path):
    """--glob '*.txt' reads the 40 text documents and never opens the binary file."""
    out = tmp_path / "tokens"
    assert prepare_main(["--out", str(out), "--glob", "*.txt", str(corpus)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train"]["documents"] + meta["val"]["documents"] == 40 and meta["skipped_files"] == 0


def test_one_text_file_is_split_at_its_tail_after_a_line_end(tmp_path):
    """One file, no --doc-sep: the last --val-fraction of its bytes is validation, cut just after the
    first line end at or past 90%; no end-of-document token at the cut, one at the file's end."""
    text = "".join(f"line {i}: {'ü' * (i % 5)} text\n" for i in range(2000))
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    raw = text.encode()
    out = tmp_path / "tokens"
    assert prepare_main(["--out", str(out), "--val-fraction", "0.1", str(tmp_path / "book.txt")]) == 0
    meta = json.loads((out / "meta.json").read_text())
    cut = raw.index(b"\n", int(len(raw) * 0.9)) + 1
    assert meta["split"] == {"rule": "tail", "val_fraction": 0.1, "cut_at_byte": cut}
    assert (meta["train"]["bytes"], meta["val"]["bytes"]) == (cut, len(raw) - cut)
    train, val = split_tokens(out, "train"), split_tokens(out, "val")
    assert train.tobytes() == np.frombuffer(raw[:cut], np.uint8).astype(np.uint16).tobytes()
    assert list(val[:-1]) == list(raw[cut:]) and val[-1] == 256 and raw[cut - 1 : cut] == b"\n"


def test_doc_sep_cuts_files_into_documents_split_by_hash(tmp_path):
    """--doc-sep '\\n\\n' (a blank line, typed with backslashes) makes each paragraph a document,
    identified as NAME#i for the hash split."""
    (tmp_path / "a.txt").write_text("\n\n".join(DOCUMENTS), encoding="utf-8")
    out = tmp_path / "tokens"
    assert (
        prepare_main(["--out", str(out), "--doc-sep", "\\n\\n", "--val-fraction", "0.3", str(tmp_path / "a.txt")]) == 0
    )
    meta = json.loads((out / "meta.json").read_text())
    in_val = [doc for i, doc in enumerate(DOCUMENTS) if goes_to_val(f"a.txt#{i}", 0.3)]
    assert meta["split"]["rule"] == "hash" and meta["val"]["documents"] == len(in_val) > 0
    assert meta["train"]["documents"] == len(DOCUMENTS) - len(in_val)
    assert np.array_equal(split_tokens(out, "val"), byte_tokens(in_val))


def write_formats(folder, documents: list[str]) -> dict[str, list]:
    """The same documents as a text file cut by a separator, JSON lines, gzipped JSON lines, Parquet and
    a datasets folder; the arguments that read each."""
    pa, pq, datasets = (
        pytest.importorskip("pyarrow"),
        pytest.importorskip("pyarrow.parquet"),
        pytest.importorskip("datasets"),
    )
    folder.mkdir()
    (folder / "docs.txt").write_text("<|sep|>".join(documents), encoding="utf-8")
    lines = "".join(json.dumps({"id": i, "body": doc}) + "\n" for i, doc in enumerate(documents))
    (folder / "docs.jsonl").write_text(lines, encoding="utf-8")
    (folder / "docs.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    pq.write_table(
        pa.table({"id": list(range(len(documents))), "body": documents}), folder / "docs.parquet", row_group_size=7
    )
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"body": documents}).save_to_disk(str(folder / "docs_dataset"))
    keyed = ["--text-key", "body"]
    return {
        "text": [str(folder / "docs.txt"), "--doc-sep", "<|sep|>"],
        "jsonl": [str(folder / "docs.jsonl"), *keyed],
        "jsonl.gz": [str(folder / "docs.jsonl.gz"), *keyed],
        "parquet": [str(folder / "docs.parquet"), *keyed],
        "datasets": [str(folder / "docs_dataset"), *keyed],
    }


@pytest.mark.slow  # the fast tier holds its 90 s (make test-all runs it)
def test_jsonl_parquet_and_datasets_give_the_tokens_of_the_same_text(tmp_path):
    """Each format of the same documents (training ones, and validation ones named by --val-files)
    writes the same token files as the documents given as text."""
    train = write_formats(tmp_path / "train", DOCUMENTS[:24])
    val = write_formats(tmp_path / "val", DOCUMENTS[24:])
    written = {}
    for kind in train:
        out = tmp_path / f"out-{kind}"
        assert prepare_main(["--out", str(out), *train[kind], "--val-files", *val[kind]]) == 0, kind
        meta = json.loads((out / "meta.json").read_text())
        assert meta["split"]["rule"] == "files" and (meta["train"]["documents"], meta["val"]["documents"]) == (24, 6)
        written[kind] = output_bytes(out)
    assert all(files == written["text"] for files in written.values())
    assert np.array_equal(split_tokens(tmp_path / "out-text", "val"), byte_tokens(DOCUMENTS[24:]))


def bpe_tokenizer(tmp_path) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(DOCUMENTS * 5, trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


@pytest.mark.slow  # the fast tier holds its 90 s (make test-all runs it)
def test_workers_and_shards_write_the_same_bytes_and_train_the_same(tmp_path, monkeypatch):
    """With a BPE tokenizer.json, --workers 2 writes byte for byte what one process writes (here in
    jobs of ~2 kB, so the workers take turns; the bytes tokenizer always runs in one process),
    --shard-tokens cuts each split into files, and training reads the shards as the one stream they
    are: the same losses as from unsharded files."""
    monkeypatch.setattr(prepare_encode, "JOB", 2000)
    monkeypatch.setattr(prepare_pieces, "PIECE", 512)  # the big file is read in pieces, cut after line ends
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(12):
        (folder / f"{i:02d}.txt").write_text("\n".join(DOCUMENTS[i:] + DOCUMENTS[:i]) * (i + 1), encoding="utf-8")
    spec = bpe_tokenizer(tmp_path)
    common = ["--tokenizer", spec, "--val-fraction", "0.25", str(folder)]
    runs = {}
    for name, extra in (
        ("one", []),
        ("two", ["--workers", "2"]),
        ("shards", ["--workers", "2", "--shard-tokens", "3000"]),
    ):
        assert prepare_main(["--out", str(tmp_path / name), *common, *extra]) == 0
        runs[name] = json.loads((tmp_path / name / "meta.json").read_text())
    assert output_bytes(tmp_path / "two") == output_bytes(tmp_path / "one")
    assert len(runs["shards"]["train"]["files"]) == math.ceil(runs["one"]["train"]["tokens"] / 3000) > 2
    for split in ("train", "val"):
        assert np.array_equal(split_tokens(tmp_path / "shards", split), split_tokens(tmp_path / "one", split))

    losses = {}
    for name in ("one", "shards"):
        run_dir = tmp_path / f"run-{name}"
        overrides = ["run.device=cpu", "tracker.name=none", f"run.output_dir={run_dir}", "data.name=text",
                     f"data.root={tmp_path / name}", "data.seq_len=16", "data.batch_size=4", "model.preset=nano",
                     "trainer.max_steps=3", "trainer.log_every=1", "trainer.val_every=null"]  # fmt: skip
        assert train_main(overrides) == 0
        losses[name] = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    strip = [{k: v for k, v in json.loads(s).items() if not k.startswith(("perf/", "time"))} for s in losses["one"]]
    assert strip == [
        {k: v for k, v in json.loads(s).items() if not k.startswith(("perf/", "time"))} for s in losses["shards"]
    ]


def write_records(path, documents: list[str]) -> tuple[list[str], list[str]]:
    """documents as the rows of a Parquet file, the lines of a JSON lines file, or the pieces of a text
    file cut by <|sep|>, as path's name says; the arguments that read them and each one's identity."""
    if path.suffix == ".parquet":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"text": documents}), path, row_group_size=7)
        return [str(path)], [f"{path.name}:{row}" for row in range(len(documents))]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents), encoding="utf-8")
        return [str(path)], [f"{path.name}:{line}" for line in range(1, len(documents) + 1)]
    path.write_text("<|sep|>".join(documents), encoding="utf-8")
    return [str(path), "--doc-sep", "<|sep|>"], [f"{path.name}#{i}" for i in range(len(documents))]


@pytest.mark.parametrize("name", ["rows.parquet", "abstracts.jsonl", "pieces.txt"])
def test_a_file_of_too_few_records_for_the_fraction_validates_its_smallest_hash(tmp_path, monkeypatch, name):
    """40 records in one file, none of which the default --val-fraction picks, still split: the record
    with the smallest hash is validation, meta.json names it, and --workers 2 writes the same bytes."""
    monkeypatch.setattr(prepare_encode, "JOB", 500)  # several jobs, so the workers take turns
    documents = [f"record {i}: " + "héllo wörld " * (i % 5 + 1) for i in range(40)]
    arguments, identities = write_records(tmp_path / name, documents)
    assert not any(goes_to_val(identity, 0.05) for identity in identities)
    smallest = min(range(40), key=lambda i: prepare_split._hash(identities[i]))
    spec = bpe_tokenizer(tmp_path)
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}"
        assert prepare_main(["--out", str(out), "--tokenizer", spec, "--workers", workers, *arguments]) == 0
        meta = json.loads((out / "meta.json").read_text())
        assert meta["split"] == {
            "rule": "hash",
            "val_fraction": 0.05,
            "fallback": "smallest_hash",
            "val_document": identities[smallest],
        }
        assert (meta["train"]["documents"], meta["val"]["documents"]) == (39, 1)
        assert meta["val"]["bytes"] == len(documents[smallest].encode())
    assert output_bytes(tmp_path / "out2") == output_bytes(tmp_path / "out1")


def test_token_folders_of_the_first_format_still_train(corpus, tmp_path):
    """A folder written before shards (train.bin, val.bin, a meta.json without file lists) reads the same
    tokens as its sharded form."""
    out = tmp_path / "tokens"
    assert prepare_main(["--out", str(out), "--val-fraction", "0.2", str(corpus)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    old = tmp_path / "old"
    old.mkdir()
    for split in ("train", "val"):
        split_tokens(out, split).tofile(old / f"{split}.bin")
        meta[split].pop("files")
    meta = {key: meta[key] for key in ("tokenizer", "vocab_size", "eot", "dtype", "train", "val")} | {"format": 1}
    (old / "meta.json").write_text(json.dumps(meta))
    for root in (out, old):
        train, val, info = build_datasets(DataConfig(name="text", root=str(root), seq_len=8), seed=0)
        assert np.array_equal(train.tokens.read(0, len(train.tokens)), split_tokens(out, "train"))
        assert len(val.tokens) == meta["val"]["tokens"] and info.vocab_size == 257


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

    return latest_checkpoint(run_dir / "checkpoints")[1]["model"]["embed_tokens.weight"].shape[0]


@pytest.mark.slow  # the fast tier holds its 90 s (make test-all runs it)
def test_bad_records_and_folders_are_one_line_errors(tmp_path, capsys):
    """A JSON line without the text field, a datasets folder of several splits, and one document (a JSON
    line, or a text file --doc-sep does not cut) with no tail split each exit 2 with one line that says
    what to do."""
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"content": "no text key"}\n')
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n')
    (tmp_path / "c.txt").write_text("one paragraph\nof two lines\n")
    cases = [
        (
            [str(tmp_path / "a.jsonl")],
            "a.jsonl:2: no 'text' field (it has 'content'); name the text field with --text-key",
        ),
        ([str(tmp_path / "dict")], f"--val-files {tmp_path / 'dict' / 'test'}"),
        ([str(tmp_path / "b.jsonl")], "no document went to the"),
        ([str(tmp_path / "c.txt"), "--doc-sep", "\\n\\n"], "one document is too few to split by hash"),
        ([str(tmp_path / "b.jsonl"), "--workers", "0"], "--workers=0 must be at least 1"),
    ]
    for number, (arguments, message) in enumerate(cases):
        assert prepare_main(["--out", str(tmp_path / f"o{number}"), *arguments]) == 2, arguments
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not (tmp_path / f"o{number}").exists() and not list(tmp_path.glob(".o*.partial"))


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


PEAK = """
import resource, subprocess, sys
subprocess.run([sys.executable, "-m", "{{ cookiecutter.package_name }}.prepare", *sys.argv[1:]], check=True,
               stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


@pytest.mark.slow
def test_prepare_memory_does_not_grow_with_the_corpus(tmp_path):
    """The peak resident memory of prepare (the largest of its processes) on 500 MB of text is that on
    50 MB, within 32 MB: it streams, whatever the corpus size."""
    line = ("the quick brown fox jumps over the lazy dog " * 3).encode() + b"\n"
    peaks = {}
    for megabytes in (50, 500):
        source = tmp_path / f"{megabytes}.txt"
        with open(source, "wb") as file:
            for _ in range(megabytes):
                file.write(line * (2**20 // len(line)))
        out = tmp_path / f"out{megabytes}"
        result = subprocess.run([sys.executable, "-c", PEAK, "--out", str(out), str(source)],
                                capture_output=True, text=True, check=True, timeout=600)  # fmt: skip
        peaks[megabytes] = int(result.stdout) // 1024  # ru_maxrss is in kB on Linux
        assert json.loads((out / "meta.json").read_text())["train"]["bytes"] > megabytes * 0.9 * 2**20 * 0.95
        source.unlink()
        for shard in out.glob("*.bin"):
            shard.unlink()
    assert peaks[500] < peaks[50] + 32, peaks
