"""Benchmarks through lm-evaluation-harness (evaluate --tasks): a multiple-choice task in JSON lines,
with a task YAML in an include folder, both written here. Our per-item log-likelihoods equal the
harness's own HFLM on the `export --format hf` folder (a random model); on a tiny model trained on the
task's kind of text, 1 and 2 processes give the same scores, a generation task stops at its stop
strings, local copies of the data are read, and bad requests are one line."""

import importlib.util
import json
import math
import re
import shutil

import pytest
import torch

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint
from {{ cookiecutter.package_name }}.engine.ckpt.restore import load_model_weights, model_and_task
from {{ cookiecutter.package_name }}.engine.config import load_config
from {{ cookiecutter.package_name }}.evaluate import main as evaluate_main
from {{ cookiecutter.package_name }}.prepare import main as prepare_main
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.task.task import Task
from {{ cookiecutter.package_name }}.train import main as train_main

from conftest import torchrun
from hf_folders import CHAT_TEMPLATE, bpe_tokenizer, jinja

lm_eval = pytest.importorskip("lm_eval")

# Items whose right answer the tiny model learns from the corpus (hf_folders.CORPUS: "line i: the quick
# brown fox jumps over the lazy dog"), one a line of JSON, and the task YAML that reads them.
ITEMS = [
    {"query": f"line {i}: the quick brown", "choices": ["fox", "dog", "cat", "lazy"], "gold": 0} for i in range(12)
]
TASK_YAML = jinja("""task: NAME
dataset_path: json
dataset_kwargs:
  data_files:
    validation: ITEMS
output_type: multiple_choice
validation_split: validation
doc_to_text: "<<query>>"
doc_to_choice: "<<choices>>"
doc_to_target: "<<gold>>"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")


# A generation task: the line's words after a cut that differs per item (so the answers take other numbers
# of forward passes) up to the stop string "lazy".
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy"]
GENERATIONS = [
    {"prompt": f"line {i}: " + " ".join(WORDS[: 1 + i % 4]), "answer": " " + " ".join(WORDS[1 + i % 4 : 7]) + " "}
    for i in range(10)
]
GENERATION_YAML = jinja("""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    validation: ITEMS
output_type: generate_until
validation_split: validation
doc_to_text: "<<prompt>>"
doc_to_target: "<<answer>>"
generation_kwargs:
  until: ["lazy"]
  max_gen_toks: 24
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")


def task_yaml(name: str, items) -> str:
    return TASK_YAML.replace("NAME", name).replace("ITEMS", str(items))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The corpus prepared with a byte-level BPE tokenizer, and an include folder holding tiny_mc (the
    ITEMS), tiny_gen (the GENERATIONS) and no_data (a task whose file is missing)."""
    root = tmp_path_factory.mktemp("benchmarks")
    (root / "tokenizer").mkdir()
    bpe_tokenizer(root / "tokenizer", root / "corpus.txt")
    assert prepare_main(["--out", str(root / "data"), "--tokenizer", str(root / "tokenizer" / "tokenizer.json"),
                         str(root / "corpus.txt")]) == 0  # fmt: skip
    (root / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(task_yaml("tiny_mc", root / "items.jsonl"))
    (tasks / "no_data.yaml").write_text(task_yaml("no_data", root / "missing.jsonl"))
    (root / "generations.jsonl").write_text("".join(json.dumps(item) + "\n" for item in GENERATIONS))
    (tasks / "tiny_gen.yaml").write_text(GENERATION_YAML.replace("ITEMS", str(root / "generations.jsonl")))
    return root


@pytest.fixture(scope="module")
def trained(prepared):
    """prepared, with a nano model trained on it for 30 steps in run/."""
    run = prepared / "run"
    args = ["run.device=cpu", "tracker.name=none", "data.name=text", f"data.root={prepared / 'data'}",
            "data.seq_len=64", "data.batch_size=8", "data.num_workers=0", "model.preset=nano",
            "trainer.max_steps=30", "trainer.val_every=30", f"run.output_dir={run}"]  # fmt: skip
    assert train_main(args) == 0
    return prepared


def our_harness_model(root, batch_size: int = 4):
    """The run's checkpoint as evaluate rebuilds it, as the harness's model."""
    from {{ cookiecutter.package_name }}.task.benchmarks import HarnessModel

    path, state = latest_checkpoint(root / "run" / "checkpoints")
    base = model_and_task(state, path, SPEC)
    cfg = load_config(SPEC, [], ["run.device=cpu", "data.name=text", f"data.root={root / 'data'}"], base=base)
    task = Task(cfg, torch.device("cpu"))
    task.datasets()
    model = task.build_model()
    load_model_weights(model, state, path)
    return HarnessModel(model, task.data.tokenizer, torch.device("cpu"), "fp32", batch_size)


def scored_by_both(prepared, folder, chat: bool = False) -> dict:
    """tiny_mc's results with logged samples, through the harness with a (random) nano model in memory
    ("ours") and with the harness's HFLM on its hf export in folder ("hflm"), at other batch sizes."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM

    from {{ cookiecutter.package_name }}.task.benchmarks import HarnessModel
    from {{ cookiecutter.package_name }}.task.harness_tasks import Request, load_tasks
    from {{ cookiecutter.package_name }}.task.model import hf

    overrides = ["run.device=cpu", "data.name=text", f"data.root={prepared / 'data'}", "data.seq_len=64",
                 "model.preset=nano", "run.seed=3"]  # fmt: skip
    task = Task(load_config(SPEC, [], overrides), torch.device("cpu"))
    task.datasets()
    model = task.build_model().eval()
    hf.write_folder(model, folder, task.data.tokenizer, task.data.tokenizer.eot)
    models = {
        "ours": HarnessModel(model, task.data.tokenizer, torch.device("cpu"), "fp32", batch_size=3, chat=chat),
        "hflm": HFLM(pretrained=str(folder), device="cpu", batch_size=5),
    }
    request, results = Request.of({"--tasks": "tiny_mc", "--include": str(prepared / "tasks")}), {}
    for name, harness_model in models.items():
        tasks, manager = load_tasks(request)
        results[name] = evaluator.simple_evaluate(
            harness_model, tasks=tasks, task_manager=manager, log_samples=True, apply_chat_template=chat
        )
    return results


def assert_same_items(results: dict) -> None:
    """Every item's log-likelihood of every choice agrees to 1e-4, and whether greedy decoding writes it, so
    acc and acc_norm are equal."""
    ours, theirs = (sorted(results[n]["samples"]["tiny_mc"], key=lambda s: s["doc_id"]) for n in ("ours", "hflm"))
    assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in theirs] == list(range(len(ITEMS)))
    for mine, other in zip(ours, theirs, strict=True):
        assert mine["arguments"] == other["arguments"]  # the same texts were scored
        for (logprob, greedy), (expected, expected_greedy) in zip(
            mine["filtered_resps"], other["filtered_resps"], strict=True
        ):
            assert logprob == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy
    for metric in ("acc,none", "acc_norm,none"):
        assert results["ours"]["results"]["tiny_mc"][metric] == results["hflm"]["results"]["tiny_mc"][metric]


def test_per_item_log_likelihoods_equal_the_harness_own_model_on_the_export(prepared, tmp_path):
    """tiny_mc through the harness with our model in memory and with HFLM on its hf export: the same
    items, item for item (assert_same_items)."""
    assert_same_items(scored_by_both(prepared, tmp_path / "hf"))


@pytest.mark.slow
def test_apply_chat_template_renders_items_in_the_run_s_template_as_the_export_s(prepared, tmp_path):
    """--apply-chat-template: each item is a user's turn in the run's chat template (the tokenizer's ChatML
    here), as HFLM renders it with the export's tokenizer_config.json, and scores the same item for item."""
    from {{ cookiecutter.package_name }}.task.chat import ChatTemplate

    results = scored_by_both(prepared, tmp_path / "hf", chat=True)
    assert_same_items(results)
    first = min(results["ours"]["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    template = ChatTemplate(CHAT_TEMPLATE, origin="test")
    turn = template.render([{"role": "user", "content": ITEMS[0]["query"]}], add_generation_prompt=True)
    assert first["arguments"][0][0] == turn and turn.startswith("<|im_start|>user")


@pytest.mark.slow
def test_generation_stops_at_its_stop_strings(trained):
    """generate_until: the model writes the corpus's line on, and the text ends before the first stop
    string (the model wrote it: it is cut off); without one it runs to max_gen_toks tokens."""
    from lm_eval.api.instance import Instance

    model = our_harness_model(trained)
    context = "line 7: the quick"
    asked = [
        ({"until": ["lazy"], "max_gen_toks": 30}),
        ({"until": ["over", "fox"], "max_gen_toks": 30}),
        ({"max_gen_toks": 3}),
    ]
    answers = model.generate_until([Instance("generate_until", {}, (context, kw), 0) for kw in asked])
    assert answers[:2] == [" brown fox jumps over the ", " brown "]
    assert len(model.tok_encode(answers[2])) == 3 and " brown fox jumps over the lazy".startswith(answers[2])


PROGRESS = re.compile(r"\d+%\|.*\|")  # a tqdm bar


def evaluate(trained, *options):
    return evaluate_main([f"run.output_dir={trained / 'run'}", f"data.root={trained / 'data'}", *options])


@pytest.mark.slow
def test_evaluate_tasks_gives_the_same_scores_on_one_and_two_processes(trained, capsys):
    """evaluate --tasks prints the scores with the validation metrics, writes eval/tiny_mc.json (scores,
    items, the harness's version, the task configuration's hash) and the scores to the run's tracker at the
    checkpoint's step (TensorBoard's, where installed: the template's CI has it), and 2 processes (each scoring
    every other item) give the same scores and report."""
    include = ["--tasks", "tiny_mc", "--include", str(trained / "tasks")]
    tracker = importlib.util.find_spec("tensorboard") is not None
    assert evaluate(trained, *include, *["tracker.name=tensorboard"] * tracker) == 0
    printed = json.loads(capsys.readouterr().out)
    if tracker:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(trained / "run" / "tensorboard"))
        events.Reload()
        logged = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
        scores = {(key, printed["step"]): value for key, value in printed.items() if key.startswith("eval/")}
        assert logged.keys() == scores.keys() and all(
            math.isclose(logged[k], v, abs_tol=1e-6) for k, v in scores.items()
        )
    report = json.loads((trained / "run" / "eval" / "tiny_mc.json").read_text())
    assert printed["eval/tiny_mc/acc"] == report["scores"]["acc"] == 1.0 and "val/loss" in printed
    assert report["items"] == len(ITEMS) and report["harness_version"] == lm_eval.__version__
    assert len(report["config_sha256"]) == 64 and printed["reports"] == [str(trained / "run" / "eval" / "tiny_mc.json")]
    shutil.rmtree(trained / "run" / "eval")
    torchrun(2, [f"run.output_dir={trained / 'run'}", f"data.root={trained / 'data'}", *include],
             script=["-m", "{{ cookiecutter.package_name }}.evaluate"])  # fmt: skip
    assert json.loads((trained / "run" / "eval" / "tiny_mc.json").read_text()) == report


@pytest.mark.slow
def test_task_data_serves_local_copies(trained, capsys, tmp_path):
    """--task-data no_data=PATH: a .jsonl file, a folder of SPLIT.parquet files and a save_to_disk folder
    of the ITEMS each give tiny_mc's scores to a task whose own data is missing; --task-data given twice
    serves two tasks."""
    import datasets

    records = datasets.Dataset.from_list(ITEMS)
    records.to_parquet(str((tmp_path / "parquet").mkdir() or tmp_path / "parquet" / "validation.parquet"))
    datasets.DatasetDict(validation=records).save_to_disk(str(tmp_path / "saved"))
    copies = [trained / "items.jsonl", tmp_path / "parquet", tmp_path / "saved"]
    include = ["--include", str(trained / "tasks")]
    for copy in copies:
        assert evaluate(trained, "--tasks", "no_data", *include, "--task-data", f"no_data={copy}") == 0, copy
        printed = json.loads(capsys.readouterr().out)
        assert printed["eval/no_data/acc"] == 1.0 and printed["eval/no_data/acc_norm"] == 1.0, copy
    two = ["--task-data", f"no_data={copies[0]}", "--task-data", f"tiny_mc={copies[2]}"]  # given twice: both
    assert evaluate(trained, "--tasks", "no_data,tiny_mc", *include, *two) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["eval/no_data/acc"] == printed["eval/tiny_mc/acc"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "options, error",
    [
        (
            ["--tasks", "hellaswagg"],
            ["--tasks hellaswagg: no such task in lm-evaluation-harness", "did you mean hellaswag"],
        ),
        (["--tasks", "no_data"], ["--tasks no_data: its data files (json: ", "missing.jsonl", "cannot be read"]),
        (["--tasks", "tiny_mc", "--num-fewshot", "9"], ["--tasks tiny_mc: an item takes", "the model's context of 64"]),
        (["--tasks", "tiny_mc", "--task-data", "other=x"], ["--task-data names other, which --tasks does not"]),
        (["--limit", "3"], ["--include, --limit go with --tasks"]),
    ],
)
def test_bad_requests_are_one_line(trained, capsys, options, error):
    """An unknown task (with the closest names), a task whose data is missing (naming the datasets command
    that fetches it), items longer than the model's context of 64 tokens (9 examples before each),
    --task-data for a task not asked for, and an option without --tasks: exit 2, one line."""
    assert evaluate(trained, *options, "--include", str(trained / "tasks")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    err = [line for line in lines if line and not PROGRESS.search(line)]  # the harness's bar as it builds the items
    assert len(err) == 1 and all(part in err[0] for part in error), err


def train_args(root, run, *extra: str) -> list[str]:
    return ["run.device=cpu", "tracker.name=none", "data.name=text", f"data.root={root / 'data'}", "data.seq_len=64",
            "data.batch_size=8", "data.num_workers=0", "model.preset=nano", "model.dropout=0.1",
            "trainer.val_every=10", "trainer.log_every=1", f"run.output_dir={run}", *extra]  # fmt: skip


@pytest.mark.slow
def test_eval_tasks_are_scored_while_training_and_after_a_resume(prepared, tmp_path):
    """trainer.eval_tasks=[tiny_mc] at every validation: metrics.jsonl holds eval/tiny_mc/acc and acc_norm
    beside val/loss at steps 10 and 20, and at 30 after a resume; trainer.monitor=eval/tiny_mc/acc_norm
    picks best.json; and training draws what a run without benchmarks draws (dropout 0.1: the harness
    seeds every generator, and they are put back), so its losses are the same."""
    from conftest import read_metrics

    scored = ["trainer.eval_tasks=[tiny_mc]", f"trainer.eval_include={prepared / 'tasks'}",
              "trainer.monitor=eval/tiny_mc/acc_norm"]  # fmt: skip
    assert train_main(train_args(prepared, tmp_path / "scored", *scored, "trainer.max_steps=20")) == 0
    assert train_main(train_args(prepared, tmp_path / "scored", *scored, "trainer.max_steps=30")) == 0  # resumes
    assert train_main(train_args(prepared, tmp_path / "plain", "trainer.max_steps=30")) == 0
    records = read_metrics(tmp_path / "scored")
    validations = [r for r in records if "val/loss" in r]
    assert [r["step"] for r in validations] == [10, 20, 30]
    assert all(
        {"eval/tiny_mc/acc", "eval/tiny_mc/acc_norm", "eval/tiny_mc/acc_stderr"} <= r.keys() for r in validations
    )
    assert validations[-1]["eval/tiny_mc/acc"] == 1.0 and "eval/best_tiny_mc/acc_norm" in validations[-1]
    best = json.loads((tmp_path / "scored" / "best.json").read_text())
    assert best["monitor"] == "eval/tiny_mc/acc_norm" and best["metrics"]["eval/tiny_mc/acc_norm"] == 1.0
    losses = lambda run: [(r["step"], r["train/loss"]) for r in read_metrics(run) if "train/loss" in r]  # noqa: E731
    assert losses(tmp_path / "scored") == losses(tmp_path / "plain")


@pytest.mark.slow
def test_two_fsdp_processes_score_while_training_as_evaluate_scores_the_checkpoint(prepared, tmp_path, capsys):
    """Under FSDP on 2 processes every forward is a collective: the benchmarks run in step (tiny_gen's
    answers take other numbers of forwards on each process) and the scores logged at step 20 equal
    evaluate --tasks on the step-20 checkpoint (the whole model on each process)."""
    from conftest import read_metrics

    run, include = tmp_path / "run", f"trainer.eval_include={prepared / 'tasks'}"
    args = train_args(prepared, run, "trainer.eval_tasks=[tiny_mc,tiny_gen]", include, "trainer.max_steps=20",
                      "distributed.strategy=fsdp", "data.batch_size=4")  # fmt: skip
    torchrun(2, args)
    logged = [r for r in read_metrics(run) if "val/loss" in r][-1]
    assert logged["step"] == 20
    assert evaluate_main([f"run.output_dir={run}", f"data.root={prepared / 'data'}", "--tasks", "tiny_mc,tiny_gen",
                          "--include", str(prepared / "tasks")]) == 0  # fmt: skip
    printed = json.loads(capsys.readouterr().out)
    for metric in ("eval/tiny_mc/acc", "eval/tiny_mc/acc_norm", "eval/tiny_gen/exact_match"):
        assert logged[metric] == printed[metric], metric
