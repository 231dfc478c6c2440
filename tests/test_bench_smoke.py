"""Smoke test of the benchmark harness (scripts/bench.py): plumbing only, no speed assertions.

Tiny shapes (model_shapes.shrunk), a counting stub in place of the timer, a torch stand-in for the package in the
plumbing test and the real package in one small end-to-end cell. Checks that every cell is produced, the accounting
follows issue 4's formulas, the JSON / Markdown / summary outputs have their structure, and the correctness checks
would catch a wrong kernel.
"""

import json
import os
from pathlib import Path

import _bench_ceilings  # scripts/ is on sys.path (conftest.py)
import bench
import pytest
import torch
from helpers import DEVICE, TOLERANCE, assert_close, needs_interpreter
from reference import W8A8_TOLERANCE
from model_shapes import MODEL_SHAPES, shrunk

ROOT = Path(__file__).resolve().parent.parent
TINY = {name: shrunk(shape) for name, shape in MODEL_SHAPES.items()}
FAKE_MS = 0.05


class CountingTimer:
    """Runs each timed function once (so it must work) and reports a fixed time."""

    def __init__(self):
        self.calls = 0

    def plain(self, fn):
        fn()
        self.calls += 1
        return FAKE_MS


class TorchKernel:
    """The package's two entry points in plain torch; `broken` scales the output to prove the check bites."""

    __name__ = "torch_stand_in"
    __version__ = "0"

    def __init__(self, broken=False):
        self.broken = broken

    def fused_experts(self, x, w_gate_up, w_down, topk_ids, topk_weights):
        out = bench.eager_experts(x, w_gate_up, w_down, topk_ids, topk_weights)
        return out * 1.5 if self.broken else out

    def fused_moe_forward(self, x, router_weight, w_gate, w_up, w_down, num_experts, top_k, gating="softmax", *,
                          renormalize=None, router_bias=None, n_group=None, topk_group=None,
                          e_score_correction_bias=None, routed_scaling_factor=1.0):
        shape = next(s for s in TINY.values() if s.num_experts == num_experts and s.top_k == top_k
                     and s.gating == gating and s.n_group == n_group)
        ids, weights = bench.torch_route(shape, x, router_weight, router_bias, e_score_correction_bias)
        w_gate_up = torch.cat([w_gate, w_up], dim=1)
        out = self.fused_experts(x, w_gate_up, w_down, ids, weights)
        return out, ids, weights.to(x.dtype)


def _common(tmp_path, models, tokens):
    return ["--device", DEVICE, "--out", str(tmp_path), "--models", models, "--tokens", tokens,
            "--ceiling-mib", "1", "--matmul-size", "64"]


def test_parse_quick_and_defaults():
    args = bench.parse_args(["--quick"])
    assert args.tokens == bench.QUICK_TOKENS
    assert bench.parse_args([]).tokens == tuple(2**i for i in range(15))
    assert bench.parse_args(["--no-baselines"]).baselines == ()
    assert bench.parse_args(["--tokens", "3,7", "--paths", "fused_experts"]).paths == ("fused_experts",)


def test_accounting_follows_issue_4():
    shape = MODEL_SHAPES["mixtral-8x7b"]
    ceilings = {"read_bytes_per_s": 4e12, "matmul_flops_per_s": 800e12}
    acct = bench.accounting(shape, 1, 2, 2, "fused_experts", ceilings)
    weights = 2 * 3 * 4096 * 14336 * 2
    assert acct["bytes"] == weights + 2 * 4096 * 2
    assert acct["flops"] == 2 * 1 * 2 * 3 * 4096 * 14336
    assert acct["bound"] == "bandwidth"
    assert acct["floor_us"] == pytest.approx(acct["bytes"] / 4e12 * 1e6)
    assert acct["target_us"] == pytest.approx(1.15 * acct["bytes"] / 4e12 * 1e6 + 10)
    big = bench.accounting(MODEL_SHAPES["deepseek-v3"], 16384, 256, 2, "fused_moe_forward", ceilings)
    assert big["bound"] == "matmul"
    assert big["target_us"] == pytest.approx(big["flops"] / (0.8 * 800e12) * 1e6 + 25)


def test_bench_plumbing(tmp_path, capsys):
    timer = CountingTimer()
    argv = _common(tmp_path, "mixtral-8x7b,deepseek-v3,gpt-oss-120b", "1,5") + [
        "--fp16-spot", "mixtral-8x7b", "--fp16-spot-tokens", "3", "--check-rows", "4"]
    results = bench.main(argv, timer=timer, kernel=TorchKernel(), shapes=TINY)

    ceilings = results["ceilings"]
    assert ceilings["read_bytes_per_s"] > 0 and ceilings["matmul_flops_per_s"] > 0
    assert len(ceilings["read_configs"]) == len(_bench_ceilings.READ_CONFIGS)

    cells = results["cells"]
    ours = [c for c in cells if c["impl"] == "moe_dispatch" and c["dtype"] == "bfloat16"]
    assert {(c["model"], c["tokens"], c["path"]) for c in ours} == {
        (m, t, p) for m in ("mixtral-8x7b", "deepseek-v3", "gpt-oss-120b") for t in (1, 5) for p in bench.PATHS}
    for c in ours:
        assert "error" not in c, c
        assert c["ok"], c
        assert c["plain_us"] == pytest.approx(FAKE_MS * 1e3)
        assert c["time_mode"] == "plain"
        assert 1 <= c["experts_hit"] <= min(c["tokens"] * TINY[c["model"]].top_k, TINY[c["model"]].num_experts)
        for key in ("bytes", "flops", "floor_us", "target_us", "time_over_floor", "tb_per_s", "tflop_per_s",
                    "meets_target", "rel_err", "vs_grouped_mm"):
            assert key in c, (key, c)
    forward = [c for c in ours if c["path"] == "fused_moe_forward"]
    assert all(c["routing_match"] == 1.0 for c in forward)

    impls = {c["impl"] for c in cells}
    assert impls == {"moe_dispatch", "grouped_mm", "vllm", "eager"}
    gmm = [c for c in cells if c["impl"] == "grouped_mm" and c["dtype"] == "bfloat16"]
    assert gmm and all(c.get("ok") for c in gmm), gmm  # the baseline itself computes the right thing
    assert all(c["error"].startswith("n/a") for c in cells if c["impl"] == "vllm")
    spot = [c for c in cells if c["dtype"] == "float16"]
    assert {(c["model"], c["tokens"], c["impl"]) for c in spot} == {("mixtral-8x7b", 3, "moe_dispatch")}

    data = json.loads((tmp_path / "bench.json").read_text())
    assert set(data) == {"meta", "shapes", "ceilings", "cells"}
    assert len(data["cells"]) == len(cells)
    md = (tmp_path / "bench.md").read_text()
    assert "## Ceilings" in md and "## deepseek-v3 (E=32, top_k=8" in md
    assert md.count("| 5 | fused_moe_forward | bfloat16 |") == 3
    assert "| deepseek-v3 | 5 |" in md  # the summary table
    summary = (tmp_path / "summary.txt").read_text()
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(summary.rstrip().splitlines()[-1])
    assert "cells missing target" in summary
    assert timer.calls > 0


def test_check_catches_a_wrong_kernel(tmp_path):
    argv = _common(tmp_path, "qwen3-30b-a3b", "4") + ["--no-baselines", "--fp16-spot", "none"]
    results = bench.main(argv, timer=CountingTimer(), kernel=TorchKernel(broken=True), shapes=TINY)
    assert results["cells"] and not any(c["ok"] for c in results["cells"])


def test_deadline_skips_cells(tmp_path):
    argv = _common(tmp_path, "mixtral-8x7b", "1,2") + ["--no-baselines", "--fp16-spot", "none",
                                                       "--deadline-s", "0"]
    results = bench.main(argv, timer=CountingTimer(), kernel=TorchKernel(), shapes=TINY)
    assert [c.get("skipped") for c in results["cells"]] == ["deadline", "deadline"]
    assert "skip" in (tmp_path / "summary.txt").read_text()


def test_real_package_one_cell(tmp_path):
    """The package itself through the harness: one tiny cell per path, checked against the float32 computation."""
    kernel = bench.load_kernel()  # the package must import and expose both entry points: a failure here is a bug
    argv = _common(tmp_path, "qwen3-30b-a3b", "5") + ["--no-baselines", "--fp16-spot", "none"]
    results = bench.main(argv, timer=CountingTimer(), kernel=kernel, shapes=TINY)
    for c in results["cells"]:
        assert "error" not in c, c
        assert c["ok"], c


def test_tune_writes_a_loadable_table(tmp_path):
    """scripts/tune on tiny shapes: the table it writes parses with the package's own tile classes."""
    import tune

    kernel = bench.load_kernel()
    tiles = __import__(kernel.__name__ + ".tiles", fromlist=["MoeTiles"])
    out = tmp_path / "table.json"
    argv = ["--device", DEVICE, "--models", "mixtral-8x7b", "--tokens", "2,8", "--max-candidates", "1",
            "--out", str(out)]
    tune.main(argv, timer=CountingTimer(), kernel=kernel, shapes=TINY)
    table = json.loads(out.read_text())
    assert table["measured"] is True and table["buckets"]
    shape = TINY["mixtral-8x7b"]
    shape_key = f"{shape.num_experts},{shape.ffn},{shape.hidden}"
    buckets = table["shapes"][shape_key]
    assert [b["max_rows_per_expert"] for b in buckets][:2] == [1, 2]
    for bucket in buckets + table["buckets"]:
        assert set(bucket) == {"max_rows_per_expert", "block_m", "gate_up", "down"}  # runtime data only
        tiles.MoeTiles.from_dict(bucket)
    history = json.loads((tmp_path / f"tuning-{table['device']}.json").read_text())  # the run's log, beside --out
    (run,) = history["runs"]
    assert [(b["shape"], b["max_rows_per_expert"]) for b in run["buckets"]] == [(shape_key, 1), (shape_key, 2)]
    assert all(set(b["measured_us"]) == {str(t) for t in b["tuned_tokens"]} for b in run["buckets"])


def test_results_name_no_machine_paths(tmp_path):
    argv = _common(tmp_path, "mixtral-8x7b", "1") + ["--no-baselines", "--fp16-spot", "none"]
    results = bench.main(argv, timer=CountingTimer(), kernel=TorchKernel(), shapes=TINY)
    text = json.dumps(results["meta"])
    assert str(tmp_path) not in text and str(ROOT) not in text


@pytest.mark.parametrize("launcher", ["bench_train", "tune_backward"])
def test_gpu_only_scripts_start(launcher):
    """The GPU-only training benchmark and backward tuner import and parse their arguments on any machine (their
    measurements need a GPU: docs/performance.md, "Training")."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(["bash", str(root / "scripts" / launcher), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "--models" in run.stdout, run.stderr[-2000:]


@needs_interpreter  # --cpu-smoke runs the kernels on CPU tensors
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sweep_decode_smoke(tmp_path, fp8):
    """scripts/sweep_decode.py --cpu-smoke on one tiny model: the outputs are written, every candidate's output was
    checked, and the table it writes holds the entry where the package reads it (the "fp8" section with --fp8)."""
    import sweep_decode

    kernel = bench.load_kernel()
    tiles = __import__(kernel.__name__ + ".tiles", fromlist=["DecodeTiles"])
    argv = ["--cpu-smoke", "--models", "gpt-oss-120b", "--tokens", "1,2", "--candidates", "2", "--out",
            str(tmp_path)] + (["--fp8"] if fp8 else [])
    results = sweep_decode.main(argv, kernel=kernel)
    tolerance = W8A8_TOLERANCE if fp8 else TOLERANCE[torch.bfloat16]
    for cell in results["cells"]:
        assert cell["general"]["rel_err"] <= tolerance, cell
        assert len(cell["decode"]["gate_up"]) == len(cell["decode"]["down"]) == 2
        assert cell["best"]["rel_err"] <= tolerance, cell
    assert str(tmp_path) not in json.dumps(results["meta"])
    data = json.loads((tmp_path / "sweep_decode.json").read_text())
    assert [c["tokens"] for c in data["cells"]] == [1, 2]
    assert "| gpt-oss-120b | 2 | 8 |" in (tmp_path / "sweep_decode.md").read_text()
    written = json.loads((tmp_path / "decode_entry.json").read_text())
    entry = written["fp8"]["decode"] if fp8 else written["decode"]
    table = json.loads((tmp_path / "interpreter.json").read_text())
    assert (table["fp8"]["decode"] if fp8 else table["decode"]) == entry
    assert table["buckets"] == tiles.load_table("interpreter")["buckets"]
    assert table["decode" if fp8 else "fp8"] == tiles.load_table("interpreter")["decode" if fp8 else "fp8"]
    for bucket in entry["buckets"] + [b for buckets in entry["shapes"].values() for b in buckets]:
        tiles.DecodeTiles.from_dict(bucket)


def _sweep_record(model, shape, tokens, top_k, decode_us, general_us, tiles=(32, 64)):
    """A measured cell as sweep_decode writes it, with a decode sweep of two candidates per kernel."""
    gate_up = {"block_n": tiles[0], "block_k": 128, "num_warps": 4, "num_stages": 3}
    down = {"block_n": tiles[1], "block_k": 128, "num_warps": 4, "num_stages": 3}
    sweep = [{"tile": f"{tiles[0]}/128/4/3", "graph_us": decode_us}, {"tile": "other", "graph_us": 2 * decode_us}]
    return {"model": model, "shape": shape, "tokens": tokens, "assignments": tokens * top_k,
            "general": {"graph_us": general_us}, "decode": {"gate_up": sweep, "down": sweep},
            "best": {"tiles": {"gate_up": gate_up, "down": down}, "graph_us": decode_us}}


def test_sweep_decode_entry_rules():
    """Per shape: buckets up to the last T of an unbroken run of decode wins, equal neighbours merged; a shape that
    never wins opts out with []; the generic limit is the smallest shape limit (0: no generic bucket)."""
    import sweep_decode

    kernel = bench.load_kernel()
    tiles = __import__(kernel.__name__ + ".tiles", fromlist=["DecodeTile"])
    cands = [tiles.DecodeTile(32, 128, 4, 3), tiles.DecodeTile(64, 128, 4, 3)]
    cells = [_sweep_record("a", "8,64,32", 1, 2, 5.0, 9.0), _sweep_record("a", "8,64,32", 2, 2, 6.0, 9.0),
             _sweep_record("a", "8,64,32", 4, 2, 7.0, 9.0, tiles=(64, 64)),
             _sweep_record("a", "8,64,32", 8, 2, 10.0, 9.0), _sweep_record("a", "8,64,32", 16, 2, 5.0, 9.0),
             _sweep_record("b", "16,32,32", 1, 4, 5.0, 9.0), _sweep_record("b", "16,32,32", 2, 4, 5.0, 9.0)]
    entry = sweep_decode.build_entry(cells, cands, cands)
    assert [b["max_assignments"] for b in entry["shapes"]["8,64,32"]] == [4, 8]  # T = 1, 2 merged; T = 8 loses
    assert [b["max_assignments"] for b in entry["shapes"]["16,32,32"]] == [8]
    (generic,) = entry["buckets"]
    assert generic["max_assignments"] == 8 and generic["gate_up"]["block_n"] == 32
    never = sweep_decode.build_entry(cells + [_sweep_record("c", "4,8,8", 1, 1, 9.0, 5.0)], cands, cands)
    assert never["shapes"]["4,8,8"] == [] and never["buckets"] == []
# --------------------------------------------------------------------------------------------------------------------
# scripts/bench_fp8.py (issue 13)


@needs_interpreter  # --cpu-smoke runs the kernels on CPU tensors
def test_bench_fp8_cpu_smoke(tmp_path, capsys):
    """The FP8 benchmark's --cpu-smoke: both moe_dispatch paths run (w8a8 forced) and pass their checks, transformers'
    path is reported as not run, the outputs have their structure and the short table is printed last."""
    import bench_fp8

    results = bench_fp8.main(["--cpu-smoke", "--out", str(tmp_path), "--models", "qwen3-30b-a3b", "--tokens", "1,5"])
    cells = results["cells"]
    assert {(c["tokens"], c["impl"]) for c in cells} == {(t, i) for t in (1, 5) for i in bench_fp8.IMPLS}
    for c in cells:
        if c["impl"] == "hf_fp8":
            assert c["error"].startswith("n/a: needs a CUDA device")
        else:
            assert "error" not in c and c["ok"], c
            assert c["plain_us"] > 0 and c["tflop_per_s"] > 0
    fp8 = [c for c in cells if c["impl"] == "fp8"]
    assert all(c["target"] == "decode" and "met" in c and c["fp8_weight_bytes"] > 0 for c in fp8)
    assert results["meta"]["fp8_compute"] == "w8a8"
    data = json.loads((tmp_path / "bench_fp8.json").read_text())
    assert set(data) == {"meta", "shapes", "ceilings", "cells"}
    assert "| qwen3-30b-a3b | 5 |" in (tmp_path / "bench_fp8.md").read_text()
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("targets missed:")


def test_bench_fp8_targets_follow_issue_13():
    """Decode: 1.15 x (fp8 weights + block scales of the experts hit) / R + 10 us on the flushed-graph time;
    prefill: 1.5x the bf16 throughput; faster than transformers' path compared in the same timing mode."""
    import bench_fp8

    shape = MODEL_SHAPES["mixtral-8x7b"]
    H, F = shape.hidden, shape.ffn
    scale_bytes = 4 * (2 * F // 128 * H // 128 + H // 128 * F // 128)
    assert bench_fp8.fp8_weight_bytes(shape, 2) == 2 * (3 * H * F + scale_bytes)
    ceilings = {"read_bytes_per_s": 4e12}
    decode = bench_fp8.judge({"fp8": {"plain_us": 500.0, "graph_flushed_us": 100.0},
                              "bf16": {"plain_us": 300.0}, "hf_fp8": {"plain_us": 400.0}}, shape, 1, 2, ceilings)
    fp8 = decode[0]
    assert fp8["target_us"] == pytest.approx(1.15 * bench_fp8.fp8_weight_bytes(shape, 2) / 4e12 * 1e6 + 10)
    assert fp8["judged_mode"] == "graph_flushed" and fp8["met"] == (100.0 <= fp8["target_us"])
    assert fp8["vs_hf_mode"] == "plain" and fp8["vs_hf"] == pytest.approx(0.8) and not fp8["faster_than_hf"]
    prefill = bench_fp8.judge({"fp8": {"plain_us": 100.0}, "bf16": {"plain_us": 149.0}}, shape, 4096, 8, ceilings)
    assert prefill[0]["target"] == "prefill" and prefill[0]["met"] is False
    prefill = bench_fp8.judge({"fp8": {"plain_us": 100.0}, "bf16": {"plain_us": 150.0}}, shape, 4096, 8, ceilings)
    assert prefill[0]["met"] is True
    assert "target" not in bench_fp8.judge({"fp8": {"plain_us": 1.0}, "bf16": {"plain_us": 1.0}}, shape, 128, 8,
                                           ceilings)[0]


# --------------------------------------------------------------------------------------------------------------------
# scripts/sweep_fp8.py and the table patching it shares with scripts/sweep_prefill.py


class FallingTimer:
    """Each measurement a tenth faster than the one before, so the last candidate a cell measures wins it: the
    winners and the table writing get exercised without a GPU."""

    def __init__(self):
        self.ms = 1.0

    def hot(self, fn):
        self.ms *= 0.9
        return self.ms

    graph = plain = hot


@needs_interpreter  # --cpu-smoke runs the kernels on CPU tensors
def test_sweep_fp8_smoke(tmp_path):
    """scripts/sweep_fp8.py --cpu-smoke on one tiny model: every stage ran and every candidate's output passed the
    w8a8 check, the winners are the last measured, and the table it writes gives each measured T its winner through
    the fp8 buckets (the bf16 ones untouched)."""
    import sweep_fp8
    import sweep_prefill
    from reference import W8A8_TOLERANCE

    kernel = bench.load_kernel()
    tiles = __import__(kernel.__name__ + ".tiles", fromlist=["MoeTiles"])
    argv = ["--cpu-smoke", "--models", "mixtral-8x7b", "--max-candidates", "3", "--out", str(tmp_path)]
    results = sweep_fp8.main(argv, kernel=kernel, timer=FallingTimer())
    cells = results["cells"]
    assert [(c["tokens"], c["rows_per_expert"], c["metric"]) for c in cells] == [(1, 1, "flushed_us"),
                                                                                 (40, 10, "hot_us")]
    for c in cells:
        assert {e["stage"] for e in c["tried"]} == {"table", "block_m", "gate_up", "down"}, c
        assert all("error" not in e and e["rel_err"] <= W8A8_TOLERANCE for e in c["tried"]), c["tried"]
        assert c["best"] is c["tried"][-1] and c["gain"] > 0.03
    assert any(e["tiles"]["block_m"] == 64 for e in cells[0]["tried"])  # the prequantized-x path ran too
    assert str(tmp_path) not in json.dumps(results["meta"])
    assert "| mixtral-8x7b | 40 | 10 | hot |" in (tmp_path / "sweep.md").read_text()
    assert len(json.loads((tmp_path / "sweep.json").read_text())["cells"]) == 2

    shipped = tiles.load_table("interpreter")
    table = json.loads((tmp_path / "interpreter.json").read_text())
    assert {k: v for k, v in table.items() if k != "fp8"} == {k: v for k, v in shipped.items() if k != "fp8"}
    assert table["fp8"]["buckets"] == shipped["fp8"]["buckets"]
    buckets = table["fp8"]["shapes"][cells[0]["shape"]]
    for c in cells:
        chosen = buckets[sweep_prefill.bucket_index(buckets, c["rows_per_expert"])]
        assert tiles.MoeTiles.from_dict(chosen) == tiles.MoeTiles.from_dict(c["best_tiles"])


@needs_interpreter  # --cpu-smoke runs the kernels on CPU tensors
def test_sweep_prefill_smoke(tmp_path):
    """scripts/sweep_prefill.py --cpu-smoke: every candidate passed the float64 check, the sweep's winner is the last
    one measured, the confirmation timed table and winner alternately (the falling timer makes the winner's later
    times faster, so the confirmed gain is positive but below the sweep's), and the table it writes gives the cell's
    bucket the winner's tiles."""
    import sweep_prefill

    kernel = bench.load_kernel()
    tiles = __import__(kernel.__name__ + ".tiles", fromlist=["MoeTiles"])
    cells = sweep_prefill.main(["--cpu-smoke", "--out", str(tmp_path)], timer=FallingTimer())
    (cell,) = cells
    assert (cell["model"], cell["tokens"], cell["select"]) == ("mixtral-8x7b", 40, "kernels")
    assert len(cell["tried"]) == 1 + 2 + 2  # the table's tiles, two gate_up and two down candidates
    assert all("error" not in e and e["rel_err"] <= 0.02 for e in cell["tried"]), cell["tried"]
    assert tiles.MoeTiles.from_dict(cell["best_tiles"]) == tiles.MoeTiles.from_dict(cell["tried"][-1]["tiles"])
    assert len(cell["confirm"]["table"]) == len(cell["confirm"]["best"]) == 2
    assert all(b < t for t, b in zip(cell["confirm"]["table"], cell["confirm"]["best"]))
    assert 0 < cell["gain"] < cell["sweep_gain"]
    assert "confirmed" in (tmp_path / "sweep.md").read_text()
    table = json.loads((tmp_path / "interpreter.json").read_text())
    buckets = table["shapes"][cell["shape"]]
    chosen = buckets[sweep_prefill.bucket_index(buckets, cell["rows_per_expert"])]
    assert tiles.MoeTiles.from_dict(chosen) == tiles.MoeTiles.from_dict(cell["best_tiles"])


def _winner(rows, gain, tiles, shape="8,64,32"):
    return {"model": "m", "shape": shape, "tokens": rows, "rows_per_expert": rows, "gain": gain, "best_tiles": tiles}


def test_sweep_table_patching():
    """patched_table: a winner takes its whole bucket (largest gain first) in the bf16 buckets; with split, in the fp8
    buckets (lent from the bf16 ones with BLOCK_K 128 when the table has none), every measured rows per expert is a
    boundary and cells without a gain keep their tiles; equal neighbours merge."""
    import sweep_prefill

    def tiles(block_m, block_k=64):
        gemm = {"block_n": 64, "block_k": block_k, "num_warps": 4, "num_stages": 3, "group_m": 8}
        return {"block_m": block_m, "gate_up": gemm, "down": gemm}

    old, a, b = tiles(16), tiles(32), tiles(64)
    table = {"buckets": [{"max_rows_per_expert": 16, **old}, {"max_rows_per_expert": 10**9, **old}]}
    cells = [_winner(1, 0.01, a), _winner(4, 0.1, a), _winner(8, 0.2, b),
             {"model": "m", "shape": "8,64,32", "tokens": 99, "skipped": "budget"}]
    plain = sweep_prefill.patched_table(table, cells, 0.03)
    assert plain["shapes"]["8,64,32"] == [{"max_rows_per_expert": 16, **b}, {"max_rows_per_expert": 10**9, **old}]
    assert plain["buckets"] == table["buckets"] and "fp8" not in plain
    split = sweep_prefill.patched_table(table, cells, 0.03, fp8=True, split=True)
    lent = tiles(16, block_k=128)
    assert split["fp8"]["buckets"] == [{"max_rows_per_expert": 16, **lent}, {"max_rows_per_expert": 10**9, **lent}]
    assert [(bucket["max_rows_per_expert"], bucket["block_m"]) for bucket in split["fp8"]["shapes"]["8,64,32"]] == [
        (1, 16), (4, 32), (8, 64), (10**9, 16)]
    assert split["buckets"] == table["buckets"] and "shapes" not in split
    assert sweep_prefill.patched_table(table, cells[:1], 0.03, fp8=True, split=True)["fp8"].get("shapes") is None


def test_gpu_state_is_optional(monkeypatch):
    """The GPU state next to each timing: nothing on the CPU, the NVML readings on a GPU (stood in for), and nothing
    when they cannot be read: a benchmark never fails for want of the bindings."""
    assert bench.gpu_state(torch.device("cpu")) == {}
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device: 1980)
    monkeypatch.setattr(torch.cuda, "temperature", lambda device: 41)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device: 650000)
    assert bench.gpu_state(torch.device("cuda")) == {"sm_mhz": 1980, "temp_c": 41, "power_w": 650.0}

    def missing(device):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "clock_rate", missing)

    def no_nvidia_smi(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(bench.subprocess, "run", no_nvidia_smi)  # the fallback reader, present on a GPU machine
    assert bench.gpu_state(torch.device("cuda")) == {}


def test_failures_are_logged_as_they_happen(tmp_path, monkeypatch):
    """scripts/gpu_suite.sh's failure log (tests/conftest.py): a failed report appends its id and crash message at
    once, passes add nothing, and without the variable nothing is written."""
    import types

    import conftest

    path = tmp_path / "failures.txt"
    crash = types.SimpleNamespace(message="AssertionError: rms rel err 3e-02 > 1e-05\n  (torch.float32)")
    failed = types.SimpleNamespace(failed=True, nodeid="tests/test_x.py::test_y[a]", when="call",
                                   longrepr=types.SimpleNamespace(reprcrash=crash))
    passed = types.SimpleNamespace(failed=False, nodeid="tests/test_x.py::test_z", when="call", longrepr=None)
    monkeypatch.delenv("MOE_DISPATCH_FAILURE_LOG", raising=False)  # a suite run's own log stays out of this test
    conftest.pytest_runtest_logreport(failed)
    assert not path.exists()
    monkeypatch.setenv("MOE_DISPATCH_FAILURE_LOG", str(path))
    conftest.pytest_runtest_logreport(passed)
    conftest.pytest_runtest_logreport(failed)
    assert path.read_text() == ("tests/test_x.py::test_y[a] (call): AssertionError: rms rel err 3e-02 > 1e-05 "
                                "(torch.float32)\n")


def test_paired_orders_alternate():
    """Paired A/B (bench.paired_graph_times): each variant once per pair, the order reversed every other pair, and
    ratios are medians of per-pair ratios against the base (a drift that moves both sides of a pair cancels)."""
    orders = bench.alternating_orders(["a", "b", "c"], 4)
    assert orders == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]
    drifting = {"base": [100.0, 120.0, 140.0], "new": [98.0, 117.6, 137.2]}  # 2% faster in every pair
    ratios = bench.median_ratios(drifting, "base")
    assert ratios["base"] == 1.0
    assert abs(ratios["new"] - 0.98) < 1e-12


def test_kernel_resources_compiles_what_a_call_launches(tmp_path):
    """scripts/kernel_resources.py in a process without the interpreter: the two decode kernels of Qwen3 T = 4 on an
    H200 are caught at launch, compiled for sm_90 and measured (registers, shared memory within the H200's limit)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(str(root / d) for d in ("scripts", "benchmarks", "torch-ext"))
    run = subprocess.run([sys.executable, str(root / "scripts" / "kernel_resources.py"), "--cells", "qwen3-30b-a3b:4",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    records = json.loads((tmp_path / "resources.json").read_text())
    assert [r["kernel"] for r in records] == ["_decode_gate_up_kernel", "_decode_down_kernel"]
    for record in records:
        assert 0 < record["registers"] <= 255 and record["sass_instructions"] > 0
        assert 0 <= record["shared"] <= 232448


def test_ab_switch_sets_and_restores_both_kinds_of_switch(monkeypatch):
    """scripts/ab_switch.py's --switch: an environment variable takes the string, a module attribute the Python
    literal; setting None puts back what was there."""
    import ab_switch
    from moe_dispatch import dispatch

    monkeypatch.delenv("MOE_DISPATCH_PDL", raising=False)
    set_env, values = ab_switch.switch_setter("MOE_DISPATCH_PDL=1,0")
    assert values == ["1", "0"]
    set_env("0")
    assert os.environ["MOE_DISPATCH_PDL"] == "0"
    set_env(None)
    assert "MOE_DISPATCH_PDL" not in os.environ
    before = dispatch.SINGLE_MAX
    set_attr, values = ab_switch.switch_setter("moe_dispatch.dispatch:SINGLE_MAX=1024,0")
    set_attr(values[1])
    assert dispatch.SINGLE_MAX == 0
    set_attr(None)
    assert dispatch.SINGLE_MAX == before


@needs_interpreter
def test_bench_host_implementations_agree():
    """scripts/bench_host.py's cells on an interpreter-sized Mixtral layer: with and without plans, through the
    transformers experts function (on the Hub benchmark's stand-in experts module) and transformers' own functions,
    every implementation gives the same output."""
    import bench_host

    import moe_dispatch as md

    shape, tokens = TINY["mixtral-8x7b"], 3
    prob = bench.make_problem(shape, tokens, torch.float32, torch.device(DEVICE), seed=0)
    topk_ids, topk_weights = bench.random_routing(tokens, shape.num_experts, shape.top_k, torch.device(DEVICE), seed=1)
    fns = bench_host.implementations(md, prob, tokens, topk_ids, topk_weights)
    assert {"plans", "no_plans", "transformers_fn", "grouped_mm"} <= set(fns)
    expected = fns["no_plans"]()
    for name, fn in fns.items():
        assert_close(fn(), expected, torch.float32, what=name)
