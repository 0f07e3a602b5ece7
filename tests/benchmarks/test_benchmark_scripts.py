"""Every benchmark script runs at its smallest settings and prints one JSON document of finite figures.

The figures themselves are machine-dependent and quoted in the README from full runs; these runs only
guard the scripts against bit rot.
"""

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from serve_app.serving.engine_contract import REPLAY_TOLERANCE
from tests.forked import run_forked

REPO = Path(__file__).resolve().parents[2]


# Runs the script named by its first argument with the given modules unimportable (a machine without them).
WITHOUT_MODULES = (
    "import runpy, sys\n"
    "for name in sys.argv[1].split(','):\n"
    "    sys.modules[name] = None\n"
    "sys.argv = sys.argv[2:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def run_script(name: str, *args: str, timeout: float = 600, without: tuple[str, ...] = ()) -> dict:
    """The script's JSON document. It runs in a process of its own, forked from the server that imported torch,
    diffusers and the trainer once (tests/forked.py), or, `without` some modules, a fresh interpreter."""
    # As RESULTS.md gives the commands: no RAY_* variable exported by hand (the tests' own are dropped), but for
    # the Serve controller's loop interval, which only saves CPU (tests/conftest.py).
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k == "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"},
           "PYTHONPATH": str(REPO)}
    command = [str(REPO / "benchmarks" / name), *args]
    if without:
        command = ["-c", WITHOUT_MODULES, ",".join(without), *command]
        done = subprocess.run([sys.executable, *command], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)  # stdout is the JSON document and nothing else
    with tempfile.TemporaryDirectory(prefix="bench-smoke-") as scratch:
        stdout, log = Path(scratch) / "stdout", Path(scratch) / "stderr"
        done = run_forked("tests.forked:script_main", command, env=env, log=log, stdout=stdout, timeout_s=timeout)
        assert done.returncode == 0, done.output[-3000:]
        return json.loads(stdout.read_text())  # stdout is the JSON document and nothing else


def numbers(value) -> list[float]:
    """Every number in a JSON document (bools are flags, not figures)."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in numbers(v)]
    return [float(value)] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def assert_finite(report: dict) -> None:
    found = numbers(report)
    assert found and all(math.isfinite(x) for x in found)


@pytest.mark.slow
def test_bench_sampler(flowgrpo_home):
    report = run_script("bench_sampler.py", "--repeats", "1", "--batch", "1", "--steps", "7", "--sizes", "tiny", "tiny-wan")
    assert_finite(report)
    image, video = report["cases"]
    assert (image["frames"], video["frames"]) == (1, 9)
    for case in (image, video):
        assert set(case["ratios"]) == {"ours_ode_vs_stock", "ours_sde_window2_vs_stock", "ours_sde_all_steps_vs_stock"}
        assert all(v["median"] > 0 for v in case["seconds"].values())
        window, all_steps = case["trajectory_bytes_per_sample"].values()
        assert 0 < window < all_steps  # the window keeps 2 steps' latents and log-probs, all-steps every step's


@pytest.mark.slow
def test_gpu_rollout_tiny(flowgrpo_home):
    """The GPU check's whole script on the CPU at the tiny models, without Ray or Hydra (as on the device):
    ~50 s. The compile check runs with the `eager` backend here (dynamo only): inductor's CPU build alone
    would take longer than the rest (tests/policies/test_compile.py checks compiled numerics)."""
    families = ["qwen_image", "sd3", "wan", "wan_i2v"]  # the default three and the image-to-video call
    report = run_script("gpu_rollout.py", "--tiny", "--repeats", "1", "--compile-backend", "eager",
                        "--families", *families, without=("ray", "hydra", "omegaconf"))
    assert_finite(report)
    assert report["mode"] == "tiny" and report["machine"]["device"] == "cpu"
    assert report["matmul"]["tflops"]["median"] > 0
    assert list(report["families"]) == families
    for family in report["families"].values():
        sampling = family["sampling"]
        cases = family["cases"]
        assert set(cases) == {"stock_pipeline", "ours_sde_window2", "ours_sde_all_steps"}
        for name, case in cases.items():
            seconds = case["seconds"]
            assert 0 < seconds["min"] <= seconds["median"] <= seconds["max"]
            assert case["seconds_per_step"]["median"] == pytest.approx(seconds["median"] / sampling["steps"])
            assert case["samples_per_s"] == pytest.approx(sampling["group"] / seconds["median"])
            if name != "stock_pipeline":  # a ratio is the ratio of the times it names
                ratio = case["ratio_to_stock"]["of_medians"]
                assert ratio == pytest.approx(seconds["median"] / cases["stock_pipeline"]["seconds"]["median"])
        transformer = family["transformer"]
        assert transformer["flops_per_step"] > 0 and transformer["rows_per_forward"] == 2 * sampling["group"]
        assert transformer["tflops"] == pytest.approx(
            transformer["flops_per_step"] / transformer["step_seconds"]["median"] / 1e12)
        consistency = family["consistency"]  # float32 on the CPU: the replay reproduces the rollout
        for replay in ("replay_same_batch", "replay_micro_batches", "replay_float32"):
            assert consistency[replay]["max_abs_log_ratio"] <= REPLAY_TOLERANCE
            assert consistency[replay]["share_outside_1+-0.0001"] == 0
        assert consistency["replay_same_batch"]["transitions"] == 2 * sampling["group"]  # a window of 2
        lora = family["lora_switch"]
        assert lora["rank"] == 64 and lora["tensors"] > 0 and lora["bytes"] > 0
        assert all(s > 0 for s in lora["seconds"].values())
    compiled = report["compile"]
    assert compiled["family"] == "sd3" and compiled["backend"] == "eager"
    assert compiled["speedup"]["of_medians"] == pytest.approx(
        compiled["eager_seconds"]["median"] / compiled["compiled_seconds"]["median"])
    assert compiled["max_abs_log_prob_difference_vs_eager"] <= REPLAY_TOLERANCE
    assert compiled["eager_replay_of_compiled_rollout"]["max_abs_log_ratio"] <= REPLAY_TOLERANCE


def test_bench_ode_solver(flowgrpo_home):
    report = run_script("bench_ode_solver.py", "--steps", "4", "--seeds", "1", "--prompts", "2", "--reference-steps", "8")
    assert_finite(report)
    rows = report["by_steps"]["4"]
    assert set(rows) == {"euler_4", "euler_2", "dpm2m_2"}
    assert rows["euler_4"]["distance_to_euler_full"]["max"] == 0.0
    assert rows["dpm2m_2"]["model_calls_per_sample"] == rows["euler_2"]["model_calls_per_sample"] == 2


@pytest.mark.slow
@pytest.mark.cluster
def test_bench_dataplane(flowgrpo_home):
    report = run_script("bench_dataplane.py", "--sizes", "64", "--repeats", "1", "--group-size", "2")
    assert_finite(report)
    (size,) = report["sizes"]
    assert size["throughput_ratio_served_over_in_process"]["median"] > 0
    per_sample = size["trajectory_bytes_per_sample"]
    moved = size["tensor_bytes_per_request"]
    # By reference: the trainer unpickles the transitions, the aggregator the images it scores, and the
    # ingress only the chunks' headers (ids, seeds, log-probs): less than one sample's tensors.
    assert moved["trainer"]["deserialized"] > 0 and moved["aggregator"]["deserialized"] > 0
    assert moved["ingress"]["deserialized"] < per_sample
    assert moved["aggregator"]["deserialized"] < per_sample * size["samples_per_request"]


@pytest.mark.slow
@pytest.mark.cluster
def test_bench_http(flowgrpo_home):
    # The rollouts at their smallest size; the publishing half deploys two more models (about 40 s), so it runs
    # in the full measurement only.
    report = run_script("bench_http.py", "--repeats", "1", "--sizes", "64", "--payloads")
    assert_finite(report)
    (size,) = report["rollouts"]
    assert size["throughput_ratio_http_over_handle"]["median"] > 0
    # The binary answer is its tensors and a header; the JSON one carries no trajectory, so it is smaller.
    assert size["binary_answer_bytes"] == size["tensor_bytes_per_sample"] * size["samples_per_request"] + \
        size["binary_header_bytes"]
    assert 0 < size["json_answer_bytes"] < size["binary_answer_bytes"]
    assert report["publish"] == {}


@pytest.mark.slow
def test_bench_learning(flowgrpo_home, tmp_path):
    report = run_script("bench_learning.py", "--minutes", "0.01", "--max-steps", "1", "--repeats", "1",
                        "--samples-per-prompt", "1", "--variants", "fast_plain", "--splits", "held_out,train",
                        "--eval-steps", "2", "--keep-weights", str(tmp_path))
    assert_finite(report)
    assert report["complete"]
    (rows,) = report["variants"]["fast_plain"]["curves"]
    assert [(row["step"], row["split"]) for row in rows] == [(0, "held_out"), (0, "train"), (1, "held_out"), (1, "train")]
    curve = [row for row in rows if row["split"] == "held_out"]
    assert all(0.0 <= row["strict_accuracy"] <= 1.0 for row in curve)
    assert (tmp_path / "fast_plain-seed0-lora_final.safetensors").is_file()  # --keep-weights
    held_out = report["variants"]["fast_plain"]["held_out"]
    change = 100 * curve[-1]["strict_accuracy_change"]
    assert held_out["strict_change_points"]["median"] == pytest.approx(change)
    assert held_out["steps"]["median"] == 1 and held_out["images_sampled"]["median"] == 64
    train = report["variants"]["fast_plain"]["train"]  # each split summarized from its own rows
    assert train["strict_change_points"]["median"] == pytest.approx(100 * rows[-1]["strict_accuracy_change"])

    # The kept adapter, evaluated by bench_eval_guidance at the rollouts' guidance (1) on the same
    # prompts and seeds, scores what the training run's own evaluations scored, base and trained.
    weights = tmp_path / "fast_plain-seed0-lora_final.safetensors"
    guided = run_script("bench_eval_guidance.py", "--weights", str(weights), "--guidance", "1,2",
                        "--samples-per-prompt", "1", "--splits", "held_out,train", "--eval-steps", "2")
    assert_finite(guided)
    assert set(guided["guidance"]) == {"1", "2"}
    for split in ("held_out", "train"):
        first, last = (row for row in rows if row["split"] == split)
        at_1 = guided["guidance"]["1"][split]
        assert at_1["base_strict_accuracy"][1] == pytest.approx(100 * first["strict_accuracy"])
        assert at_1["trained_strict_accuracy"][1] == pytest.approx(100 * last["strict_accuracy"])
        assert at_1["paired_change_points"][1] == pytest.approx(100 * last["strict_accuracy_change"])
        for scale in guided["guidance"].values():
            lo, value, hi = scale[split]["paired_change_points"]
            assert lo <= value <= hi


def _bench_learning_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_learning", REPO / "benchmarks" / "bench_learning.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_every_bench_learning_variant_is_a_trainer_config():
    """A variant's overrides are read only when a benchmark run reaches it, minutes in: each must load as a config."""
    from serve_app.trainer.config import load_trainer_config

    bench = _bench_learning_module()
    algorithms = {name: load_trainer_config("trainer/shapes", overrides).trainer.algorithm
                  for name, overrides in bench.VARIANTS.items()}
    assert algorithms["demo"] == "flow_grpo" and algorithms["diffusion_nft_soft_late"] == "diffusion_nft"


def test_bench_learning_pairs_a_variant_with_the_baseline_of_its_repeat_on_the_same_images():
    """The paired difference against the demo: per repeat, the mean over images of (variant - baseline) on each
    (prompt, seed), whatever order the two runs listed their images in; its interval resamples prompts."""
    from serve_app.trainer.evaluation import PairedReference

    bench = _bench_learning_module()

    def scores(values: dict) -> dict:
        return {"held_out": PairedReference(5, values)}

    baseline = {("a", 0): 0.0, ("a", 1): 1.0, ("b", 0): 0.0, ("b", 1): 0.0, ("c", 0): 1.0, ("c", 1): 0.0}
    better = {("c", 1): 1.0, ("b", 1): 1.0, ("b", 0): 1.0, ("a", 1): 1.0, ("a", 0): 1.0, ("c", 0): 1.0}  # +4 of 6
    result = bench.paired_against([scores(better), scores(baseline)], [scores(baseline), scores(baseline)], "held_out")
    assert result["per_repeat"] == [pytest.approx(200 / 3), 0.0]
    (lo, hi), same = result["prompt_interval_points"]
    # Prompts a and c gain one image of two, b two of two: a resample's mean lies between 50 and 100 points.
    assert 50.0 <= lo < 200 / 3 < hi <= 100.0 and same == [0.0, 0.0]
    assert result["strict_difference_points"]["median"] == pytest.approx(100 / 3)
    assert (result["repeats_above"], result["repeats_below"]) == (1, 0)
    with pytest.raises(ValueError, match="not the same ones"):  # other images cannot be paired
        bench.paired_against([scores({("a", 0): 1.0})], [scores(baseline)], "held_out")


@pytest.mark.slow
@pytest.mark.cluster
def test_bench_pipeline(flowgrpo_home):
    report = run_script("bench_pipeline.py", "--steps", "1", "--repeats", "1", "--staleness", "0,1",
                        "--noise-prompts", "1", "--noise-group-size", "2", "--prompts-per-step", "2", "--group-size", "2")
    assert_finite(report)
    assert report["training"]["k1"]["speedup_over_k0"]["median"] > 0
    assert 0 < report["training"]["k0_step_shares"]["rollout"] < 1
    assert report["group_noise"]["shared_over_independent"]["median"] > 0
    # 1 prompt x 2 samples, 10 steps, window at 4: 20 rows independent, 1 * 4 + 2 * 6 = 16 shared
    assert report["group_noise"]["transformer_row_bound"] == pytest.approx(20 / 16)


@pytest.mark.slow
@pytest.mark.cluster
def test_bench_weights(flowgrpo_home):
    report = run_script("bench_weights.py", "--repeats", "1")
    assert_finite(report)
    lora = report["payloads"]["shapes_lora"]
    assert 0 < lora["bytes"] < report["payloads"]["small_full_transformer"]["bytes"]
    assert {"filesystem", "object_store"} <= set(lora)


@pytest.mark.slow
def test_bench_rewards(flowgrpo_home):
    report = run_script("bench_rewards.py", "--repeats", "1", "--prompts", "2", "--group-size", "2", "--size", "32",
                        "--steps", "4", "--reward-seconds", "0.5", "--server-calls", "4", "--server-call-seconds", "0.01")
    assert_finite(report)
    latency = report["latency"]["request_seconds"]
    assert set(latency) == {"streaming", "after_merge", "sampling_only"}
    # Scoring is never free: both scored modes wait for at least one 0.5 s reward call beyond sampling
    # (half of it asserted: sampling these tiny requests varies by far less than 0.25 s).
    assert all(latency[m]["median"] >= latency["sampling_only"]["median"] + 0.25 for m in ("streaming", "after_merge"))
    assert all(v["images_per_second"]["median"] > 0 for k, v in report["reward_server"].items() if k.startswith("max_"))
