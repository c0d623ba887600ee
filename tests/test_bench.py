"""`vtp-runtime bench`, `benchmarks/step.py` and `benchmarks/generate.py` where no GPU is: a clear refusal, the
plot redrawn from the committed H200 results, tiny smoke runs (the timing itself runs on the GPU machine, never
in CI)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from vtp_runtime.tools import bench

RESULTS = ROOT / "benchmarks" / "results" / "h200_final.json"


def test_refuses_without_a_gpu():
    run = subprocess.run(
        [sys.executable, "-m", "vtp_runtime", "bench", "--ops", "jsd"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2
    assert "needs a CUDA GPU" in run.stderr


def test_model_bytes_counts_the_passes_of_the_performance_model():
    n, v = 1024, 75968
    assert bench.model_bytes("jsd", n, v, 2) == 7 * n * v * 2  # 3 reads of both inputs + 1 write
    assert bench.model_bytes("kl", n, v, 2) == 5 * n * v * 2
    for op in ("cross_entropy", "logprobs", "entropy"):
        assert bench.model_bytes(op, n, v, 2) == 3 * n * v * 2  # read, re-read in backward, write


def test_replot_and_table_from_committed_results(tmp_path, capsys):
    data = json.loads(RESULTS.read_text())
    assert data["rows"] and data["copy_gbps"] > 1000
    png = tmp_path / "bench.png"
    bench.replot(str(RESULTS), str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    bench.print_table([bench.Row(**r) for r in data["rows"]], data["copy_gbps"], None)
    out = capsys.readouterr().out
    assert "device-to-device copy" in out and "jsd" in out and "triton" in out


def test_logprobs_entropy_arm_matches_the_dense_arm_on_cpu():
    """The arm timed against ``logprobs``: log-probs and entropy with a gradient through
    both, the same gradient as dense PyTorch's (CPU, eager backend)."""
    import torch

    z, y = bench.make_inputs("logprobs_entropy", 6, 50, torch.float32, "cpu", seed=0)
    (got,) = bench.vtp_arm("eager", "logprobs_entropy", z, y, 0.5)()
    (want,) = bench.torch_arm("logprobs_entropy", z, y, 0.5)()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_entropy_overhead_compares_with_logprobs_alone(capsys):
    rows = [
        bench.Row("logprobs", "triton", 1, 1024, 151936, "bfloat16", ms=0.50, graph_ms=0.40),
        bench.Row("logprobs_entropy", "triton", 1, 1024, 151936, "bfloat16", ms=0.55, graph_ms=0.42),
    ]
    assert bench.entropy_overhead(rows) == {("triton", 1, 1024): 0.42 / 0.40}
    bench.print_table(rows, 4000.0, None)
    assert "logprobs_entropy / logprobs" in capsys.readouterr().out


def test_head_mode_refuses_without_a_gpu():
    run = subprocess.run(
        [sys.executable, "-m", "vtp_runtime", "bench", "--head", "64"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2
    assert "needs a CUDA GPU" in run.stderr and "--device cpu" in run.stderr


def test_head_mode_runs_on_cpu_at_tiny_sizes(tmp_path):
    """`bench --head` end to end on the CPU: every arm, JSON rows and the plot of time and
    memory against N (memory is a CUDA measurement: absent on the CPU)."""
    out, png = tmp_path / "head.json", tmp_path / "head.png"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "vtp_runtime",
            "bench",
            "--head",
            "16",
            "--tokens",
            "24,48",
            "--vocab",
            "101",
            "--tp",
            "1,2",
            "--device",
            "cpu",
            "--backends",
            "eager",
            "--peers",
            "torch",
            "--warmup",
            "1",
            "--reps",
            "2",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert data["mode"] == "head" and data["hidden"] == 16
    arms = {(r["op"], r["arm"]) for r in data["rows"]}
    assert arms == {
        ("cross_entropy", "materialized:eager"),
        ("cross_entropy", "fused:eager"),
        ("cross_entropy", "fused_none:eager"),
        ("cross_entropy", "torch"),
        ("jsd", "materialized:eager"),
        ("jsd", "fused:eager"),
    }
    assert len(data["rows"]) == 6 * 2 * 2  # arms x TP sizes x token counts
    for r in data["rows"]:
        assert not r["error"] and r["ms"] > 0 and r["temp_gib"] is None
        assert r["v_local"] == 101 // r["tp"]
        if r["arm"].startswith("materialized"):
            assert r["vs_mat"] == 1.0
    assert "fused:eager" in run.stdout and "vs_mat" in run.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_head_per_token_arm_gives_the_gradients_of_its_weighted_loss():
    """The ``fused_none`` arm (per-token values, a random upstream gradient) times the
    gradients of ``sum(g * ce) / N``, here against dense PyTorch on CPU with the eager backend."""
    import torch
    import torch.nn.functional as F

    from vtp_runtime.tools import bench_head

    gen = torch.Generator().manual_seed(3)
    h = torch.randn(12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 40, (12,), generator=gen)
    got = bench_head.head_arm("cross_entropy", "fused_none", "eager", h, w, y, None, None, 0.5)()
    g = torch.rand(12, generator=torch.Generator().manual_seed(0), dtype=torch.float32).double()
    want = torch.autograd.grad((F.cross_entropy(h @ w.T, y, reduction="none") * g).sum() / 12, (h, w))
    assert g.std() > 0.1  # the tokens' upstream gradients differ
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_step_benchmark_runs_on_cpu_and_its_losses_agree(tmp_path):
    """`benchmarks/step.py` at tiny sizes on the CPU: a row per arm, a skipped arm says why,
    and the fused head's loss of the same model and tokens is the fp32 cross entropy's; on
    the transformers model, the fused head's (`fuse_lm_head`) and vtp's loss on the logits
    are transformers' own."""
    out = tmp_path / "step.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the head on the eager backend
    arms = ["torch_fp32", "vtp_head", "liger"]
    if importlib.util.find_spec("transformers") is not None:
        arms += ["hf_torch", "hf_vtp_loss", "hf_vtp_fused", "hf_liger", "hf_liger_lce", "hf_liger_vtp"]
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "step.py"),
            "--device",
            "cpu",
            "--dim",
            "64",
            "--layers",
            "1",
            "--heads",
            "4",
            "--vocab",
            "512",
            "--tokens",
            "256",
            "--seq",
            "128",
            "--reps",
            "1",
            "--warmup",
            "1",
            "--arms",
            ",".join(arms),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(arms)
    for skipped in [a for a in ("liger", "hf_liger", "hf_liger_lce", "hf_liger_vtp") if a in arms]:
        assert rows[skipped]["note"].startswith("skipped:") and rows[skipped]["ms"] is None
    for arm in [a for a in ("torch_fp32", "vtp_head", "hf_torch", "hf_vtp_loss", "hf_vtp_fused") if a in arms]:
        r = rows[arm]
        assert not r["note"] and r["ms"] > 0 and r["peak_gib"] is None and r["batch"] == 2 and r["seq"] == 128
        assert arm in run.stdout
    # random labels over V=512 at this init: a loss near log(512) = 6.2, not a degenerate 0 or NaN
    assert 4.0 < rows["torch_fp32"]["loss"] < 9.0
    assert abs(rows["vtp_head"]["loss"] - rows["torch_fp32"]["loss"]) < 1e-2 * rows["torch_fp32"]["loss"]
    if "hf_torch" in rows:
        assert 4.0 < rows["hf_torch"]["loss"] < 9.0
        for vtp_arm in ("hf_vtp_loss", "hf_vtp_fused"):  # one model and batch: the same bf16 loss
            assert abs(rows[vtp_arm]["loss"] - rows["hf_torch"]["loss"]) < 1e-2 * rows["hf_torch"]["loss"], vtp_arm


def test_step_benchmark_undoes_ligers_rebinding():
    """Liger's patch rebinds names in transformers' Llama module (RMSNorm, MLP, RoPE, the
    forward): after its arms, benchmarks/step.py restores them, so the next arm runs stock
    transformers. (The Liger arms themselves run on CUDA only.)"""
    import argparse

    if importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("transformers") is None:
        import pytest

        pytest.skip("liger-kernel and transformers are needed")
    spec = importlib.util.spec_from_file_location("step_benchmark", ROOT / "benchmarks" / "step.py")
    assert spec is not None and spec.loader is not None
    step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step)
    from transformers.models.llama import modeling_llama

    before = dict(vars(modeling_llama)), modeling_llama.LlamaForCausalLM.forward
    args = argparse.Namespace(vocab=64, dim=32, layers=1, heads=4, seq=16, device="cpu", dtype="float32")
    for arm in step.LIGER_HF:
        saved = step.llama_names()
        model = step.hf_model(arm, args, 64)
        assert "forward" in model.__dict__, arm  # Liger's fused forward, or fuse_lm_head's
        if arm != "hf_liger_lce":  # its RoPE, RMSNorm and SwiGLU rebind the module's names
            assert dict(vars(modeling_llama)) != before[0], arm
        step.restore_llama(saved)
        assert dict(vars(modeling_llama)) == before[0] and modeling_llama.LlamaForCausalLM.forward is before[1], arm


def test_sampling_ops_run_on_cpu_at_tiny_sizes(tmp_path):
    """`bench --ops sample,...` end to end on the CPU: every op, vtp and the gather-then-sample peer."""
    out = tmp_path / "sample.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "vtp_runtime",
            "bench",
            "--ops",
            "sample,sample_top_k,sample_top_p,argmax",
            "--device",
            "cpu",
            "--vocab",
            "101",
            "--tokens",
            "1,8",
            "--tp",
            "1,2",
            "--backends",
            "eager",
            "--warmup",
            "1",
            "--reps",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert data["mode"] == "sample" and len(data["rows"]) == 4 * 2 * 2 * 2  # ops x N x TP x arms
    for r in data["rows"]:
        assert not r["error"] and r["ms"] > 0 and r["v_local"] == 101 // r["tp"]
    assert {r["arm"] for r in data["rows"]} == {"eager", "torch"}
    assert "sample_top_p" in run.stdout and "x peer" in run.stdout


def test_sampling_peers_draw_from_the_restricted_distributions():
    """The peer arms are what they stand for: transformers' top-k and top-p warpers' support."""
    import torch

    from vtp_runtime.testing import reference
    from vtp_runtime.tools import bench_sample

    torch.manual_seed(0)
    x = torch.randn(4000, 60) * 2
    x[:] = x[0]
    for op, options in (
        ("sample_top_k", {"top_k": bench_sample.TOP_K}),
        ("sample_top_p", {"top_p": bench_sample.TOP_P}),
    ):
        ids = bench_sample.peer_arm(op, list(x.split(30, dim=-1)))()
        support = reference.sampling_distribution(x[:1], **options)[0] > 0
        assert support[ids].all() and torch.unique(ids).numel() > 1
    assert torch.equal(bench_sample.peer_arm("argmax", [x])(), x.argmax(-1))


def test_generate_benchmark_runs_on_cpu_at_tiny_sizes(tmp_path):
    """`benchmarks/generate.py` at tiny sizes on the CPU: every row times both arms, greedy
    decoding gives the same ids with and without vtp's sampler, and with the static cache
    compiled (dynamo's eager backend here) the vtp arm decodes through the forward the torch
    arm compiled: no frame compiled, no graph break."""
    import pytest

    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install -e '.[integrations]')")
    out = tmp_path / "generate.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # vtp's eager backend
    args = ["--device", "cpu", "--tiny", "--batches", "1", "--modes", "greedy,top_p", "--new-tokens", "3"]
    args += ["--reps", "1", "--compile-backend", "eager", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "generate.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["cache"], r["mode"]) for r in rows] == [
        ("dynamic", "greedy"),
        ("dynamic", "top_p"),
        ("static", "greedy"),
        ("static", "top_p"),
    ]
    for r in rows:
        # (times at these sizes are noise: a difference of two calls can even come out negative)
        assert not r["note"] and all(isinstance(r[k]["ms"], float) for k in ("torch", "vtp")), r
        assert r["same_ids"] is (True if r["mode"] == "greedy" else None), r
        compiled = "yes" if r["cache"] == "static" else "no"
        assert r["torch"]["compiled"] == r["vtp"]["compiled"] == compiled, r
        assert r["vtp"]["frames_warmup"] == r["vtp"]["frames_timed"] == r["torch"]["frames_timed"] == 0, r
        assert r["torch"]["graph_breaks"] == r["vtp"]["graph_breaks"] == 0, r
    assert rows[2]["torch"]["frames_warmup"] >= 1  # the compile, in the first static row's torch arm


# == 9. the benchmark command line ==========================================================


@pytest.mark.parametrize(
    "argv",
    [
        ["--ops", "cross_entropy"],
        [
            "--head",
            "8",
            "--device",
            "cpu",
            "--tokens",
            "4",
            "--vocab",
            "16",
            "--tp",
            "1",
            "--peers",
            "",
            "--warmup",
            "0",
            "--reps",
            "1",
        ],
    ],
    ids=["logits", "head"],
)
def test_bench_names_an_unknown_backend_and_fails(argv):
    """Item 9: ``vtp-runtime bench --backends nosuch`` exits non-zero with a message naming
    the unknown backend, before it times anything (also where no GPU is)."""
    run = subprocess.run(
        [sys.executable, "-m", "vtp_runtime", "bench", "--backends", "eager,nosuch", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "nosuch" in run.stderr, (run.returncode, run.stdout, run.stderr)
