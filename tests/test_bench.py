"""The benchmark runs end to end and measures what it claims (correctness, no timing asserts)."""

import importlib.util
import json
import math
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, background_result

FIGURES = [
    *(f"step_s/{m}/{c}" for m in ("mlp", "resnet18") for c in ("generated", "raw", "lightning")),
    *(f"faults_per_step/{m}/{c}" for m in ("mlp", "resnet18") for c in ("generated", "raw")),
    "step_s/resnet18/raw_cached",
    "faults_per_step/resnet18/raw_cached",
    *(f"ratio/resnet18/generated_over_raw_cached_paired{q}" for q in ("", "_q1", "_q3")),
    *(f"startup_s/{c}" for c in ("generated", "raw", "lightning")),
    "startup_overhead_s/generated",
    "startup_overhead_s/lightning",
    "ddp_accum4/skip_sync/allreduce_rounds_per_step",
    "ddp_accum4/sync_every_micro/allreduce_rounds_per_step",
    "samples_per_s/1_process",
    "samples_per_s/2_process",
    "data_wait/resnet18_workers",
    *(
        f"ratio/{m}/generated_over_{c}_paired{q}"
        for m in ("mlp", "resnet18")
        for c in ("raw", "lightning")
        for q in ("", "_q1", "_q3")
    ),
    *(f"ops_per_step/mlp/{c}" for c in ("generated", "raw", "lightning")),
    *(
        f"loader_224px/{h}_handoff/{k}"
        for h in ("uint8", "float")
        for k in ("worker_ms_per_sample", "images_per_s")
    ),
    "loader_224px/worker_cpu_float_over_uint8",
    "loader_224px/images_per_s_uint8_over_float",
    # The language model: generated vs raw, paired, and tokens/s.
    "params/lm",
    *(f"step_s/lm/{c}" for c in ("generated", "raw")),
    *(f"faults_per_step/lm/{c}" for c in ("generated", "raw")),
    "ratio/lm/generated_over_raw",
    *(f"ratio/lm/generated_over_raw_paired{q}" for q in ("", "_q1", "_q3")),
    *(f"tokens_per_s/lm/{c}" for c in ("generated", "raw", "generated_logged")),
    *(f"ops_per_step/lm/{c}" for c in ("generated", "raw")),
    # Scale (quick: a 3M-parameter model): memory of full vs sharded saves, async stall, meta build.
    "scale/params",
    "scale/share_gb",
    *(f"scale/save_extra_gb/{k}" for k in ("full", "sharded", "async")),
    *(f"scale/save_blocked_s/{k}" for k in ("full", "sharded", "async", "async_first")),
    *(f"scale/step_s/{k}" for k in ("full", "sharded", "async")),
    *(f"scale/build_peak_extra_gb/{k}" for k in ("meta", "eager")),
    "scale/ratio/save_extra_over_share/sharded",
    "scale/ratio/async_stall_over_sync",
    "scale/ratio/build_peak_meta_over_eager",
]


def quick_check(work: Path) -> list:
    """One short repetition of every benchmark: a correctness check, not timings."""
    return [sys.executable, ROOT / "bench" / "run.py", "--quick", "--json", work / "cpu.json"]


def gpu_check(work: Path) -> list:
    """The GPU benchmark's cases, briefly on the CPU."""
    return ["bash", ROOT / "bench" / "gpu.sh", "--cpu-check", "--json", work / "gpu.json"]


# Both start when the session starts and run beside the other tests (conftest.py).
BACKGROUND = {"quick": quick_check, "gpu_cpu_check": gpu_check}


def background_json(name: str, command, results: str) -> tuple[str, dict]:
    """A BACKGROUND command's stdout and the JSON results it wrote, once it succeeded."""
    code, stdout, stderr, work = background_result(name, command, timeout=1800)
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    return stdout, json.loads((work / results).read_text())


@pytest.fixture(scope="module")
def quick():
    """One quick benchmark run: its stdout and its JSON results."""
    pytest.importorskip("lightning")
    return background_json("quick", quick_check, "cpu.json")


@pytest.fixture(scope="module")
def gpu_cpu_check():
    """bench/gpu.sh --cpu-check: its stdout and its JSON results."""
    pytest.importorskip("tokenizers")
    return background_json("gpu_cpu_check", gpu_check, "gpu.json")


def test_every_figure_is_printed_as_a_name_value_line(quick):
    """Each figure appears as `name: value`, equal to the JSON results, and is a real number."""
    stdout, results = quick
    printed = dict(
        line.split(": ", 1) for line in stdout.splitlines() if ": " in line and "|" not in line
    )
    for name in FIGURES:
        assert name in results["figures"], name
        value = results["figures"][name]
        assert math.isfinite(value) and float(printed[name]) == pytest.approx(value, rel=1e-5)
    assert "| figure | value | target | holds |" in stdout


def test_accumulation_all_reduces_once_per_step_and_the_counter_sees_every_round(quick):
    """With 4 micro-batches per step, the generated loop all-reduces once per optimizer step;
    without skipping the sync the same counter sees 4 rounds, so it can fail."""
    figures = quick[1]["figures"]
    assert figures["ddp_accum4/skip_sync/allreduce_rounds_per_step"] == 1.0
    assert figures["ddp_accum4/sync_every_micro/allreduce_rounds_per_step"] == 4.0


def test_language_model_figures_are_consistent(quick):
    """Both language-model contenders train the micro GPT (0.8M parameters; run.py stops the
    benchmark if their parameters or tokens differ); tokens/s is 32 x 128 tokens over the median
    step; the LM ratios are among the targets."""
    from importlib import util

    spec = util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    run = util.module_from_spec(spec)
    spec.loader.exec_module(run)
    figures = quick[1]["figures"]
    assert 0.7e6 < figures["params/lm"] < 0.9e6
    for contender in ("generated", "raw"):
        assert figures[f"tokens_per_s/lm/{contender}"] == pytest.approx(
            32 * 128 / figures[f"step_s/lm/{contender}"]
        )
    q1, median, q3 = (figures[f"ratio/lm/generated_over_raw_paired{q}"] for q in ("_q1", "", "_q3"))
    assert q1 <= median <= q3
    targets = {name for name, _, _ in run.TARGETS}
    assert {"ratio/lm/generated_over_raw", "ratio/lm/generated_over_raw_paired"} <= targets


def test_scale_figures_are_consistent(quick):
    """The quick scale run trains a 3.2M-parameter GPT on 2 FSDP processes: each rank's share of
    the state is 3 fp32 copies (weights, two Adam moments) of half the parameters; the ratios are
    those of their figures, and the three scale targets are in the target table."""
    from importlib import util

    spec = util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    run = util.module_from_spec(spec)
    spec.loader.exec_module(run)
    f = quick[1]["figures"]
    assert 3e6 < f["scale/params"] < 3.4e6
    assert f["scale/share_gb"] == pytest.approx(3 * 4 * f["scale/params"] / 2 / 1e9, rel=0.01)
    assert f["scale/ratio/save_extra_over_share/sharded"] == pytest.approx(
        f["scale/save_extra_gb/sharded"] / f["scale/share_gb"]
    )
    assert all(f[f"scale/save_blocked_s/{k}"] > 0 for k in ("full", "sharded", "async"))
    targets = {name for name, _, _ in run.TARGETS}
    assert {
        "scale/ratio/save_extra_over_share/sharded",
        "scale/ratio/async_stall_over_sync",
        "scale/ratio/build_peak_meta_over_eager",
    } <= targets


def test_times_and_shares_are_in_range(quick):
    """Step and start-up times and loader speeds are positive; the data-wait share is a fraction."""
    figures = quick[1]["figures"]
    assert all(
        figures[n] > 0
        for n in FIGURES
        if n.startswith(("step_s/", "startup_s/", "samples", "loader_", "ops_"))
    )
    assert 0 <= figures["data_wait/resnet18_workers"] <= 1


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc malloc's")
def test_the_generated_loop_reuses_freed_memory_where_raw_faults_it_in_again(quick):
    """Each raw ResNet-18 step faults its activations in again (glibc's default allocator); the
    generated loop's CPU allocator setting, also applied to raw as raw_cached, reuses them."""
    figures = quick[1]["figures"]
    raw = figures["faults_per_step/resnet18/raw"]
    assert raw > 1000
    # The first steps still grow the heap (small blocks can split a freed one): not all reuse.
    assert figures["faults_per_step/resnet18/generated"] < raw / 4
    assert figures["faults_per_step/resnet18/raw_cached"] < raw / 4


def test_report_rewrites_only_the_marked_section_and_draws_the_plot(quick, tmp_path):
    """report.py replaces only the text between the markers (idempotently) and writes a PNG."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("report", ROOT / "bench" / "report.py")
        report = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(report)
        page = tmp_path / "performance.md"
        marked = f"{report.START}\nSTALE-RESULTS\n{report.END}"
        page.write_text(f"# Performance\n\nkept\n\n{marked}\n\nafter\n")
        gpu = {"device": "Test GPU", "torch": "2.x", "cases": {}}
        for _ in range(2):
            report.write_docs(quick[1], gpu, page, tmp_path / "bench.png")
            text = page.read_text()
            assert text.startswith("# Performance\n\nkept\n") and text.endswith("after\n")
            assert "STALE-RESULTS" not in text and "| tiny MLP, s/step |" in text
            assert "GPU: Test GPU" in text
            assert "Language model (task=language-model, micro GPT" in text
        assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_gpu_benchmark_runs_every_case_and_counts_model_flops(gpu_cpu_check):
    """bench/gpu.sh --cpu-check runs every case briefly on the CPU (the GPU itself is not here):
    each case's figures are finite, the FLOPs per sample are counted from the project's own models
    (its ResNet-18 at 32x32: 0.28 GFLOP forward, 3x that with backward; a transformer: 6N plus
    attention per token), and report.py renders the results."""
    stdout, results = gpu_cpu_check
    spec = importlib.util.spec_from_file_location("gpu", ROOT / "bench" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    assert list(results["cases"]) == list(gpu.CASES)
    for name, case in results["cases"].items():
        for key in ("samples_per_s", "step_time_ms", "tflops", "mfu_of_matmul_ceiling"):
            assert math.isfinite(case[key]) and case[key] > 0, (name, key, case[key])
        assert 0 <= case["data_wait"] <= 1, (name, case)
        assert f"gpu/{name}/samples_per_s: " in stdout
        if name.startswith("resnet18_32px"):
            # The small-input stem (3x3, stride 1) keeps the max-pool: a quarter of the CIFAR
            # ResNet-18's 1.11 GFLOP forward; backward costs about twice the forward.
            assert 0.27 < case["gflop_per_sample_forward"] < 0.29, case
            assert 2.9 < case["gflop_per_sample"] / case["gflop_per_sample_forward"] < 3.0, case
            assert 11.1 < case["params_m"] < 11.3, case  # ResNet-18, 10 classes
        elif "lora" in name:
            # Over a frozen base, backward computes the inputs' gradients through every matrix
            # (about one forward) but the weights' for the adapters only: below full training's 3x.
            assert 2.0 < case["gflop_per_sample"] / case["gflop_per_sample_forward"] < 2.9, case
        else:
            tokens, layers, width = 64, 2, 64  # --cpu-check: the nano preset, 64-token windows
            # 6N without the position table and the layer norms' (4 x width a layer and 2 x width
            # at the end: no matrix products), plus 12 x layers x width x tokens for attention
            matmul_params = case["params_m"] * 1e6 - tokens * width - (4 * layers + 2) * width
            expected = 6 * matmul_params + 12 * layers * width * tokens
            assert case["gflop_per_token"] * 1e9 == pytest.approx(expected, rel=1e-6), case
            assert case["tokens_per_s"] == pytest.approx(case["samples_per_s"] * tokens)
    assert (
        results["matmul_bf16_tflops"] > 0 and results["bf16_peak_tflops"] is None
    )  # no data-sheet peak for a CPU
    assert gpu.peak_tflops("NVIDIA H200") == 989.0 and gpu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu.peak_tflops("NVIDIA H200 NVL") == 835.0
    assert gpu.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0 and gpu.peak_tflops("Unknown") is None

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import report

        section = report.gpu_section(results)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert all(f"| {name} |" in section for name in gpu.CASES)
    earlier = json.loads((ROOT / "bench" / "results" / "gpu.json").read_text())
    assert all(f"| {name} |" in report.gpu_section(earlier) for name in earlier["cases"])


def test_instruction_count_refuses_to_run_outside_callgrind(tmp_path):
    """`contenders.py instructions` switches callgrind's count at the first timed step; run
    without valgrind it stops there with a message, instead of reporting nothing as a count."""
    command = [sys.executable, str(ROOT / "bench" / "contenders.py"), "instructions"]
    command += ["--contender", "raw", "--model", "mlp", "--warmup", "2", "--steps", "1"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "could not switch callgrind's count on" in done.stderr, done.stderr[-2000:]


def test_a_missed_target_is_named_and_the_timed_run_fails():
    """Each figure that misses its target gets a `target missed:` line naming it, its value and the
    target (a timed run prints them and exits 1); figures that hold, or were not measured, none."""
    from importlib import util

    spec = util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    run = util.module_from_spec(spec)
    spec.loader.exec_module(run)
    figures = {"lm_demo/val_loss_over_floor": 1.113, "lm_demo/wall_s": 150.0, "demo/val_acc": 0.95}
    line = "target missed: lm_demo/val_loss_over_floor = 1.113, wanted <= 1.065"
    assert run.missed(figures) == [line]
    assert run.missed({**figures, "lm_demo/val_loss_over_floor": 1.05}) == []
    source = (ROOT / "bench" / "run.py").read_text()
    assert "return 1 if misses else 0" in source  # main's exit status follows missed()


def test_the_timm_side_by_side_makes_its_images_and_reads_timms_log(tmp_path):
    """bench/timm_train.py: scikit-learn's digits as a 32x32 RGB ImageFolder, every fifth image of a
    class for validation; timm's logged batch times read without the first batch of an epoch."""
    spec = importlib.util.spec_from_file_location("bench_timm", ROOT / "bench" / "timm_train.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.digits_folder(tmp_path) == (1442, 355)
    from PIL import Image

    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == [str(d) for d in range(10)]
    with Image.open(next((tmp_path / "train" / "3").glob("*.png"))) as image:
        assert (image.size, image.mode) == ((32, 32), "RGB")
    log = (
        "Train: 0 [   0/22 (  0%)]  Loss: 2.31 (2.31)  Time: 1.912s,   33.47/s  (1.912s, 33.47/s)\n"
        "Train: 0 [   5/22 ( 24%)]  Loss: 2.30 (2.30)  Time: 0.151s,  423.04/s  (0.160s, 400.5/s)\n"
        "Train: 1 [  21/22 (100%)]  Loss: 2.10 (2.20)  Time: 0.162s,  395.06/s  (0.166s, 385.5/s)\n"
    )
    assert bench.batch_times(log) == [0.151, 0.162]
