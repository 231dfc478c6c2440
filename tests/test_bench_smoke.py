"""The tools of scripts/ on the CPU: plumbing and decisions, no speed assertions.

- The forward benchmark (scripts/bench.py on the harness, scripts/harness.py): tiny shapes (model_shapes.shrunk), a
  counting stub in place of the timer, a torch stand-in for the package in the plumbing test and the real package in
  one small end-to-end cell. Every cell is produced, the accounting follows the targets' formulas, the JSON /
  Markdown / summary outputs have their structure, and the correctness checks catch a wrong kernel.
- The tuner (scripts/tune.py), one interpreter-sized run per path with a stub timer of known costs: the table it
  writes gives each measured T the tiles the run chose (read back through the package's own tile selection), a
  candidate off the reference is rejected however fast, and the table's choice is kept when nothing beats it; plus the
  decode entry's and the fp8 buckets' rules on made-up records.
- The FP8 benchmark, the host-time benchmark's implementations, the harness's GPU-state reader and paired orders, the
  launchers of the GPU-only tools (`--help`), and the GPU suite's failure log.
- The weight-layout benchmark (scripts/bench_layouts.py): its --smoke run at T = 1 (every layout agrees with the
  reference layout), its kernel-name -> stage mapping on made-up profiles, and the layouts it builds.
- The MXFP4 benchmark (scripts/bench_mxfp4.py): its --cpu-smoke run (the package on MXFP4 weights and on their bf16
  values against the float64 experts, the Hub peers skipped with a reason), its decode floor and prefill ratio, the
  finegrained-fp8 layout it converts our weights into, and how it finds and imports the Hub peers.
- The end-to-end generate benchmark's MXFP4 mode (benchmarks/generate_e2e.py --quantize mxfp4): its arguments, the MoE
  blocks it swaps around one router, and its CPU smoke run (the package's tokens equal transformers' eager loop on the
  dequantized experts; transformers' MXFP4 path, GPU-only, skipped with the reason in every cell).
- The training benchmark's frozen mode (scripts/bench_train.py --frozen): its arguments and its --cpu-smoke run (the
  package's backward through frozen FP8 and MXFP4 experts against the same call on their bf16 values: d x and
  d topk_weights only, no weight gradient).
"""

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import bench  # scripts/ is on pytest.ini's pythonpath
import harness
import pytest
import torch
import tune
from helpers import DEVICE, TOLERANCE, assert_close, needs_interpreter
from kernel_build import PREFERRED_VARIANT
from model_shapes import MODEL_SHAPES, shrunk
from moe_dispatch.reference import W8A8_TOLERANCE

ROOT = Path(__file__).resolve().parent.parent
TINY = {name: shrunk(shape) for name, shape in MODEL_SHAPES.items()}
# Narrower still where only the plumbing is checked (H = 64, F = 32: every GEMM has one or two 32-wide tiles per
# dimension in the interpreter table, so a tuner trial runs a handful of programs).
SMALL = {name: shrunk(shape, hidden=64, ffn=32, num_experts=min(8, shape.num_experts))
         for name, shape in MODEL_SHAPES.items()}
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
        out = harness.eager_experts(x, w_gate_up, w_down, topk_ids, topk_weights)
        return out * 1.5 if self.broken else out

    def fused_moe_forward(self, x, router_weight, w_gate, w_up, w_down, num_experts, top_k, gating="softmax", *,
                          renormalize=None, router_bias=None, n_group=None, topk_group=None,
                          e_score_correction_bias=None, routed_scaling_factor=1.0):
        shape = next(s for s in TINY.values() if s.num_experts == num_experts and s.top_k == top_k
                     and s.gating == gating and s.n_group == n_group and s.router_bias == (router_bias is not None)
                     and s.renormalize == bool(renormalize))
        ids, weights = harness.torch_route(shape, x, router_weight, router_bias, e_score_correction_bias)
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


def test_accounting_follows_the_targets():
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
    assert len(ceilings["read_configs"]) == len(harness.READ_CONFIGS)

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
    """The package itself through the harness: one tiny cell per path, checked against the float32 computation
    (Mixtral's routing at T = 1: the harness's plumbing, not the kernels' edges, which tests/test_moe.py covers)."""
    kernel = harness.load_kernel()  # the package must import and expose both entry points: a failure here is a bug
    argv = _common(tmp_path, "mixtral-8x7b", "1") + ["--no-baselines", "--fp16-spot", "none"]
    results = bench.main(argv, timer=CountingTimer(), kernel=kernel, shapes=TINY)
    for c in results["cells"]:
        assert "error" not in c, c
        assert c["ok"], c


@needs_interpreter  # --cpu-smoke runs the kernels on CPU tensors
def test_bench_fp8_cpu_smoke(tmp_path, capsys, monkeypatch):
    """The FP8 benchmark's --cpu-smoke: both moe_dispatch paths run (w8a8 forced) and pass their checks, transformers'
    path is reported as not run, the outputs have their structure and the short table is printed last. Tiny Mixtral
    (top-2 of 8) at T = 1 (2 assignments: the fp8 decode kernels) and T = 7 (14 > the interpreter table's 12: the
    general w8a8 kernels); the CPU timer's repeats cut to one (the times are plumbing, not measurements)."""
    import functools

    import bench_fp8

    monkeypatch.setattr(harness, "WallTimer", functools.partial(harness.WallTimer, repeats=1))
    results = bench_fp8.main(["--cpu-smoke", "--out", str(tmp_path), "--models", "mixtral-8x7b", "--tokens", "1,7"])
    cells = results["cells"]
    assert {(c["tokens"], c["impl"]) for c in cells} == {(t, i) for t in (1, 7) for i in bench_fp8.IMPLS}
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
    assert "| mixtral-8x7b | 7 |" in (tmp_path / "bench_fp8.md").read_text()
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("targets missed:")


def test_bench_fp8_targets():
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


def test_results_name_no_machine_paths(tmp_path):
    argv = _common(tmp_path, "mixtral-8x7b", "1") + ["--no-baselines", "--fp16-spot", "none"]
    results = bench.main(argv, timer=CountingTimer(), kernel=TorchKernel(), shapes=TINY)
    text = json.dumps(results["meta"])
    assert str(tmp_path) not in text and str(ROOT) not in text


@pytest.mark.parametrize("launcher", ["tune", "bench_train", "bench_ep", "bench_layouts", "bench_mxfp4"])
def test_launchers_start(launcher):
    """The launchers of tools without a CPU run of their own here (the training and expert-parallel benchmarks need
    GPUs; bench_ep starts through torchrun), and the layout and MXFP4 benchmarks' (their smoke tests run in-process),
    import their script and parse its arguments on any machine; the tuner's launcher says its paths."""
    run = subprocess.run(["bash", str(ROOT / "scripts" / launcher), "--help"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "MOE_DISPATCH_RANKS": "1"})
    assert run.returncode == 0 and "--models" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    if launcher == "tune":
        assert "--path {general,decode,fp8,backward}" in run.stdout


class RecordingKernel:
    """The package, with the tiles and token count of its last fused_experts call recorded; outputs of the tiles
    `spoil(tiles)` picks come back scaled by 1.5 (a candidate that compiles and runs but computes the wrong thing)."""

    def __init__(self, package, spoil=lambda tiles: False):
        self.package, self.spoil, self.last = package, spoil, None
        self.__name__ = package.__name__

    def __getattr__(self, name):
        return getattr(self.package, name)

    def fused_experts(self, x, *args, tiles=None, **kwargs):
        self.last = (x.shape[0], tiles)
        out = self.package.fused_experts(x, *args, tiles=tiles, **kwargs)
        return out * 1.5 if self.spoil(tiles) else out


class CostTimer:
    """The tuner's timer with known costs: runs the call, then 1 ms for the first tiles it saw at a T (the table's
    choice, always timed first) and `others` ms for any other; without a recording kernel (the backward) 1 ms for
    every call, without running it (the tuner ran it once for its check)."""

    def __init__(self, kernel=None, others=0.5):
        self.kernel, self.others, self.first = kernel, others, {}

    def time(self, fn, select):
        assert select in tune.SELECTS
        if self.kernel is None:
            return 1.0
        fn()
        tokens, tiles = self.kernel.last
        return 1.0 if self.first.setdefault(tokens, tiles) == tiles else self.others


def _tune(tmp_path, path, models, tokens, timer, kernel, shapes=TINY, extra=()):
    argv = ["--path", path, "--cpu-smoke", "--models", models, "--tokens", tokens, "--max-candidates", "1",
            "--finalists", "1", "--pairs", "1", "--out", str(tmp_path / "table.json"), *extra]
    table = tune.main(argv, timer=timer, kernel=kernel, shapes=shapes)
    (run,) = json.loads((tmp_path / "tuning-interpreter.json").read_text())["runs"]  # the log, beside --out
    assert run["path"] == path and str(tmp_path) not in json.dumps(run["argv"])
    if table is not None:
        assert json.loads((tmp_path / "table.json").read_text()) == json.loads(json.dumps(table))
    return table, run["units"]


def _read_back(monkeypatch, tiles, table):
    """The package's tile selection reading `table` as the device's table."""
    monkeypatch.setattr(tiles, "load_table", lambda key: table)


@needs_interpreter  # the kernels run on CPU tensors
def test_tune_general_path(tmp_path, monkeypatch):
    """The general path on a tiny Mixtral (H = 64, F = 32) at T = 2 and 8 (two buckets): the spoilt gate_up candidate
    is rejected by the float64 check although its time would win, the down candidate (faster than the table's tiles)
    wins, register caps are tried on both GEMMs of the chosen tiles, and the table gives each T the chosen tiles
    through tiles.select_tiles; tune's layout keeps runtime data only."""
    package = harness.load_kernel()
    tiles = package.tiles
    # the first gate_up candidate of BLOCK_M 16 (tune.GENERAL_TILES), never the interpreter table's
    kernel = RecordingKernel(package,
                             spoil=lambda t: t is not None and (t.gate_up.block_n, t.gate_up.block_k) == (32, 128))
    table, units = _tune(tmp_path, "general", "mixtral-8x7b", "2,8", CostTimer(kernel), kernel, shapes=SMALL)
    shape = SMALL["mixtral-8x7b"]
    assert [u["max_rows_per_expert"] for u in units] == [1, 2]
    _read_back(monkeypatch, tiles, table)
    for unit in units:
        spoilt = [t for t in unit["tried"] if t["stage"] == "gate_up"]
        assert spoilt and all(t["error"].startswith("ValueError: rel err") for t in spoilt), unit["tried"]
        capped = [t for t in unit["tried"] if t["stage"].endswith("maxnreg")]  # register caps on the chosen tiles
        assert {t["stage"] for t in capped} == {"gate_up maxnreg", "down maxnreg"}, unit["tried"]
        for t in capped:  # "bm.. gu n/k/w/s/g[/rCAP] dn n/k/w/s/g[/rCAP]": the cap on the stage's GEMM
            gate_up, down = t["tiles"].split(" dn ")
            assert "/r" in (gate_up if t["stage"].startswith("gate_up") else down), t
        assert unit["changed"] and unit["gain"] == pytest.approx(1.0) and unit["best"] != unit["table"]
        assert all(t["rel_err"] <= TOLERANCE[torch.bfloat16] for t in unit["tried"] if "error" not in t)
        (t,) = unit["tokens"]
        chosen = tiles.select_tiles(torch.device(DEVICE), t, shape.top_k, shape.num_experts, shape.ffn, shape.hidden)
        assert chosen == tiles.MoeTiles.from_dict(unit["best"])
    assert table["measured"] is True and table["device"] == "interpreter"
    for bucket in table["shapes"][tune.shape_key(shape)] + table["buckets"]:
        assert set(bucket) == {"max_rows_per_expert", "block_m", "gate_up", "down"}


@needs_interpreter
def test_tune_decode_path(tmp_path, monkeypatch):
    """The decode path on a tiny GPT-OSS (H = 64, F = 32, top-4 of 8) at T = 1, 2: the decode tiles beat the general
    path's (by the stub's costs), so the table's decode entry gives both T the chosen tiles through
    tiles.select_decode_tiles, and the generic bucket covers the shape's limit."""
    package = harness.load_kernel()
    kernel = RecordingKernel(package)
    table, units = _tune(tmp_path, "decode", "gpt-oss-120b", "1,2", CostTimer(kernel), kernel, shapes=SMALL)
    shape = SMALL["gpt-oss-120b"]
    assert [u["assignments"] for u in units] == [shape.top_k, 2 * shape.top_k]
    assert all(u["changed"] and "block_m" in u["table"] and "block_m" not in u["best"] for u in units)
    assert table["decode"]["buckets"][0]["max_assignments"] == 2 * shape.top_k
    assert table["fp8"] == package.tiles.load_table("interpreter")["fp8"]  # the float8 entry untouched
    _read_back(monkeypatch, package.tiles, table)
    for unit in units:
        (t,) = unit["tokens"]
        chosen = package.tiles.select_decode_tiles(torch.device(DEVICE), t, shape.top_k, shape.num_experts, shape.ffn,
                                                   shape.hidden)
        assert chosen == package.tiles.DecodeTiles.from_dict(unit["best"])


@needs_interpreter
def test_tune_fp8_path(tmp_path, monkeypatch):
    """The w8a8 path on a tiny Mixtral (H = 64, F = 32: one 128-wide scale block, partly filled) at T = 1 and 40: every
    candidate passed the w8a8 check (register caps tried on both GEMMs too), and the "fp8" buckets (split at each
    measured rows per expert) give each T its winner through tiles.select_fp8_tiles, the bf16 buckets untouched."""
    package = harness.load_kernel()
    kernel = RecordingKernel(package)
    table, units = _tune(tmp_path, "fp8", "mixtral-8x7b", "1,40", CostTimer(kernel), kernel, shapes=SMALL)
    shape = SMALL["mixtral-8x7b"]
    shipped = package.tiles.load_table("interpreter")
    assert {k: v for k, v in table.items() if k != "fp8"} == {k: v for k, v in shipped.items() if k != "fp8"}
    _read_back(monkeypatch, package.tiles, table)
    for unit in units:
        assert unit["changed"] and all(t["rel_err"] <= W8A8_TOLERANCE for t in unit["tried"]), unit["tried"]
        assert {t["stage"] for t in unit["tried"]} >= {"gate_up maxnreg", "down maxnreg"}, unit["tried"]
        (t,) = unit["tokens"]
        chosen = package.tiles.select_fp8_tiles(torch.device(DEVICE), t, shape.top_k, shape.num_experts, shape.ffn,
                                                shape.hidden)
        assert chosen == package.tiles.MoeTiles.from_dict(unit["winner"])


@needs_interpreter
@pytest.mark.parametrize("path,tokens", [("decode", "1,2"), ("general", "1,8")])
def test_tune_mxfp4(tmp_path, monkeypatch, path, tokens):
    """--mxfp4 on a tiny GPT-OSS (H = 64, F = 32: whole e8m0 groups; E = 8) at two T (two units): every candidate runs
    the MXFP4 blocks and passes the float64 check on their dequantized values, a candidate beats the table's tiles
    (the stub's costs), and the table's "mxfp4" section gives each T the chosen tiles through the package's
    selection with mxfp4=True, while the float weights' entries and selection stay as shipped."""
    package = harness.load_kernel()
    tiles, device = package.tiles, torch.device(DEVICE)
    kernel = RecordingKernel(package)
    small = {"gpt-oss-120b": shrunk(MODEL_SHAPES["gpt-oss-120b"], hidden=64, ffn=32, num_experts=8)}
    shape = small["gpt-oss-120b"]
    table, units = _tune(tmp_path, path, "gpt-oss-120b", tokens, CostTimer(kernel), kernel, shapes=small,
                         extra=["--mxfp4"])
    shipped = tiles.load_table("interpreter")
    head = ("mxfp4", "device", "measured", "note")
    assert {k: v for k, v in table.items() if k not in head} == {k: v for k, v in shipped.items() if k not in head}
    assert len(units) == 2
    dims = (shape.top_k, shape.num_experts, shape.ffn, shape.hidden)
    _read_back(monkeypatch, tiles, table)
    for unit in units:
        assert all("error" not in t and t["rel_err"] <= TOLERANCE[torch.bfloat16] for t in unit["tried"]), unit
        assert unit["changed"]
        (t,) = unit["tokens"]
        if path == "decode":
            chosen = tiles.select_decode_tiles(device, t, *dims, mxfp4=True)
            assert chosen == tiles.DecodeTiles.from_dict(unit["best"]) and chosen.down.dot
        else:
            assert tiles.select_tiles(device, t, *dims, mxfp4=True) == tiles.MoeTiles.from_dict(unit["best"])
            assert all(b[g].get("persistent", "off") == "off" for b in table["mxfp4"]["shapes"][tune.shape_key(shape)]
                       for g in ("gate_up", "down"))
    monkeypatch.setattr(tiles, "load_table", lambda key: shipped)
    assert tiles.select_tiles(device, 1, *dims) == tiles.select_tiles(device, 1, *dims, mxfp4=True)


@needs_interpreter
def test_tune_keeps_a_measured_tables_note(tmp_path):
    """A general-path run on a measured base table keeps its note (where each earlier part came from); on an
    unmeasured one the note says the table is tune's."""
    package = harness.load_kernel()
    kernel = RecordingKernel(package)
    small = {"gpt-oss-120b": shrunk(MODEL_SHAPES["gpt-oss-120b"], hidden=64, ffn=32, num_experts=8)}
    base = dict(package.tiles.load_table("interpreter"), measured=True, note="the buckets came from sweep 3")
    (tmp_path / "base.json").write_text(json.dumps(base))
    table, _ = _tune(tmp_path, "general", "gpt-oss-120b", "8", CostTimer(kernel), kernel, shapes=small,
                     extra=["--mxfp4", "--base", str(tmp_path / "base.json")])
    assert table["note"] == "the buckets came from sweep 3" and table["measured"]
    (tmp_path / "unmeasured").mkdir()
    table, _ = _tune(tmp_path / "unmeasured", "general", "gpt-oss-120b", "8", CostTimer(kernel), kernel, shapes=small,
                     extra=["--mxfp4", "--base", str(package.tiles.table_path("interpreter"))])
    assert table["note"].startswith("measured by scripts/tune")


@needs_interpreter
def test_tune_backward_path(tmp_path):
    """The backward path on Qwen3's routing at E = 8, H = 64, F = 32 (the interpreter's weight-gradient tile is small:
    many programs) and T = 4, every candidate as fast as the default: each candidate's gradients matched the
    default's, no table is written and the default is kept (nothing beat it)."""
    package = harness.load_kernel()
    small = {"qwen3-30b-a3b": shrunk(MODEL_SHAPES["qwen3-30b-a3b"], hidden=64, ffn=32, num_experts=8)}
    table, units = _tune(tmp_path, "backward", "qwen3-30b-a3b", "4", CostTimer(), package, shapes=small)
    assert table is None and not (tmp_path / "table.json").exists()
    (unit,) = units
    assert {t["stage"] for t in unit["tried"]} == {"table", "weight_tile", "gemm_tiles"}
    assert all("error" not in t and t["rel_err"] <= TOLERANCE[torch.bfloat16] for t in unit["tried"]), unit["tried"]
    assert not unit["changed"] and unit["best"] == unit["table"] and unit["gain"] == pytest.approx(0.0)
    package.tiles.WeightGradTile(**unit["best"]["weight_tile"])


def _decode_record(shape, tokens, top_k, decode_us, general_us, tiles=(32, 64)):
    """A decode unit as the tuner records it: a gate_up stage of two candidates (the first the given tiles), and the
    chosen tiles where the decode path won."""
    tiles_module = harness.load_kernel().tiles
    first = tiles_module.DecodeTiles(tiles_module.DecodeTile(tiles[0], 128, 4, 3),
                                     tiles_module.DecodeTile(tiles[1], 128, 4, 3))
    other = dataclasses.replace(first, gate_up=tiles_module.DecodeTile(128, 128, 4, 3))
    stage = [tune.Trial(candidate, "gate_up", {"gate_up", "down"}, {tokens: ms})
             for candidate, ms in ((first, decode_us), (other, 2 * decode_us))]
    return {"shape": shape, "tokens": [tokens], "assignments": tokens * top_k, "changed": decode_us < general_us,
            "best": first.to_dict(), "_trials": stage}


def test_decode_entry_rules():
    """Per shape: buckets up to the last T of an unbroken run of decode wins, equal neighbours merged; a shape that
    never wins opts out with []; the generic limit is the smallest shape limit (0: no generic bucket)."""
    records = [_decode_record("8,64,32", 1, 2, 5.0, 9.0), _decode_record("8,64,32", 2, 2, 6.0, 9.0),
               _decode_record("8,64,32", 4, 2, 7.0, 9.0, tiles=(64, 64)),
               _decode_record("8,64,32", 8, 2, 10.0, 9.0), _decode_record("8,64,32", 16, 2, 5.0, 9.0),
               _decode_record("16,32,32", 1, 4, 5.0, 9.0), _decode_record("16,32,32", 2, 4, 5.0, 9.0)]
    entry = tune.DecodePath.entry(records)
    assert [b["max_assignments"] for b in entry["shapes"]["8,64,32"]] == [4, 8]  # T = 1, 2 merged; T = 8 loses
    assert [b["max_assignments"] for b in entry["shapes"]["16,32,32"]] == [8]
    (generic,) = entry["buckets"]
    assert generic["max_assignments"] == 8 and generic["gate_up"]["block_n"] == 32
    never = tune.DecodePath.entry(records + [_decode_record("4,8,8", 1, 1, 9.0, 5.0)])
    assert never["shapes"]["4,8,8"] == [] and never["buckets"] == []


def _winner(rows, gain, tiles, shape="8,64,32"):
    return {"shape": shape, "rows_per_expert": rows, "gain": gain, "best_tiles": tiles}


def test_fp8_table_patching():
    """patched_table: in the fp8 buckets (lent from the bf16 ones with BLOCK_K 128 when the table has none), every
    measured rows per expert of a shape with a winner is a boundary, cells without a gain keep their tiles, equal
    neighbours merge; the bf16 buckets stay; no winner, no per-shape list."""

    def tiles(block_m, block_k=64):
        gemm = {"block_n": 64, "block_k": block_k, "num_warps": 4, "num_stages": 3, "group_m": 8}
        return {"block_m": block_m, "gate_up": gemm, "down": gemm}

    old, a, b = tiles(16), tiles(32), tiles(64)
    table = {"buckets": [{"max_rows_per_expert": 16, **old}, {"max_rows_per_expert": 10**9, **old}]}
    cells = [_winner(1, 0.01, a), _winner(4, 0.1, a), _winner(8, 0.2, b)]
    split = tune.patched_table(table, cells, 0.03)
    lent = tiles(16, block_k=128)
    assert split["fp8"]["buckets"] == [{"max_rows_per_expert": 16, **lent}, {"max_rows_per_expert": 10**9, **lent}]
    assert [(bucket["max_rows_per_expert"], bucket["block_m"]) for bucket in split["fp8"]["shapes"]["8,64,32"]] == [
        (1, 16), (4, 32), (8, 64), (10**9, 16)]
    assert split["buckets"] == table["buckets"] and "shapes" not in split
    assert tune.patched_table(table, cells[:1], 0.03)["fp8"].get("shapes") is None


def test_gpu_state_is_optional(monkeypatch):
    """The GPU state next to each timing: nothing on the CPU, the NVML readings on a GPU (stood in for), and nothing
    when they cannot be read: a benchmark never fails for want of the bindings."""
    assert harness.gpu_state(torch.device("cpu")) == {}
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device: 1980)
    monkeypatch.setattr(torch.cuda, "temperature", lambda device: 41)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device: 650000)
    assert harness.gpu_state(torch.device("cuda")) == {"sm_mhz": 1980, "temp_c": 41, "power_w": 650.0}

    def missing(device):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "clock_rate", missing)

    def no_nvidia_smi(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(harness.subprocess, "run", no_nvidia_smi)  # the fallback reader, present on a GPU machine
    assert harness.gpu_state(torch.device("cuda")) == {}


def test_paired_orders_alternate():
    """Paired A/B (harness.paired_graph_times): each variant once per pair, the order reversed every other pair, and
    ratios are medians of per-pair ratios against the base (a drift that moves both sides of a pair cancels)."""
    orders = harness.alternating_orders(["a", "b", "c"], 4)
    assert orders == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]
    drifting = {"base": [100.0, 120.0, 140.0], "new": [98.0, 117.6, 137.2]}  # 2% faster in every pair
    ratios = harness.median_ratios(drifting, "base")
    assert ratios["base"] == 1.0
    assert abs(ratios["new"] - 0.98) < 1e-12


@needs_interpreter
def test_bench_host_implementations_agree():
    """scripts/bench_host.py's cells on an interpreter-sized Mixtral layer: with and without plans, through the
    transformers experts function (on the Hub benchmark's stand-in experts module) and transformers' own functions,
    every implementation gives the same output."""
    import bench_host

    import moe_dispatch as md

    shape, tokens = TINY["mixtral-8x7b"], 3
    prob = harness.make_problem(shape, tokens, torch.float32, torch.device(DEVICE), seed=0)
    topk_ids, topk_weights = harness.random_routing(tokens, shape.num_experts, shape.top_k, torch.device(DEVICE),
                                                    seed=1)
    fns = bench_host.implementations(md, prob, tokens, topk_ids, topk_weights)
    assert {"plans", "no_plans", "transformers_fn", "grouped_mm"} <= set(fns)
    expected = fns["no_plans"]()
    for name, fn in fns.items():
        assert_close(fn(), expected, torch.float32, what=name)


@needs_interpreter
def test_bench_host_training_implementations_agree():
    """scripts/bench_host.py --train's cells on an interpreter-sized Mixtral layer: the four gradients of every
    implementation (with and without plans, through the transformers experts function, transformers' grouped_mm)
    agree, and the package's second and third calls replay their forward and backward plans."""
    import bench_host

    import moe_dispatch as md

    shape, tokens = TINY["mixtral-8x7b"], 5
    prob = harness.make_problem(shape, tokens, torch.float32, torch.device(DEVICE), seed=0)
    topk_ids, topk_weights = harness.random_routing(tokens, shape.num_experts, shape.top_k, torch.device(DEVICE),
                                                    seed=1)
    grad_out = torch.randn(tokens, shape.hidden, device=DEVICE)
    fns = bench_host.training_implementations(md, prob, tokens, topk_ids, topk_weights, grad_out)
    assert {"plans", "no_plans", "transformers_fn", "grouped_mm"} <= set(fns)
    expected = fns["no_plans"]()
    for name, fn in fns.items():
        for what, got, want in zip(("x", "w_gate_up", "w_down", "topk_weights"), fn(), expected):
            assert_close(got, want, torch.float32, what=f"{name} d{what}")
    fns["plans"]()  # recorded (or replayed: the cache may hold this signature from above)
    replays = bench_host.plan_replays(md, fns["plans"])
    assert (replays["forward"], replays["backward"]) == (3, 3), replays


# The weight-layout benchmark (scripts/bench_layouts.py).


def test_layouts_smoke(tmp_path, capsys):
    """--smoke on one model at T = 1 (the whole pipeline, interpreter-sized): every layout runs both modes and agrees
    with the reference layout (output and every gradient, mapped back), the reference layout with the float64
    experts, transformers' GPT-OSS experts with both; the JSON and Markdown have their structure and the short table
    is printed last. On the CPU the profiler sees no device kernels (empty stages); on a GPU each layout's GEMM1 and
    GEMM2 are found."""
    import bench_layouts as bl

    results = bl.main(["--smoke", "--models", "gpt-oss-20b", "--tokens", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "layouts.json").read_text())
    assert set(data) == {"meta", "cells", "unmapped_kernels"}
    assert {"device", "torch", "triton", "transformers", "git_commit", "args", "argv", "stage_rules"} <= set(data["meta"])
    assert str(tmp_path) not in json.dumps(data["meta"])
    (cell,) = data["cells"]
    assert (cell["model"], cell["T"], cell["E"], cell["top_k"], cell["H"], cell["F"]) == ("gpt-oss-20b", 1, 4, 2, 64, 32)
    assert cell["activation"] == "swiglu_oai" and cell["biases"] and cell["errors"] == {}
    check = cell["check"]
    others = {layout.name for layout in bl.LAYOUTS} - {bl.BASE}
    assert set(check["forward_rel_diff"]) == set(check["grad_rel_diff"]) == others
    grads = {"x", "w_gate_up", "w_down", "topk_weights", "gate_up_bias", "down_bias"}
    assert all(set(g) == grads for g in check["grad_rel_diff"].values())
    assert check["ok"], check
    assert max(check["forward_rel_diff"].values()) <= cell["tolerance"]
    assert check["reference_vs_float64"] <= cell["tolerance"]
    peer = bl.PEER in cell["modes"]["inference"]["whole_ms"]
    if peer:  # transformers imports here (requirements.txt): its experts compute the same function
        assert check["peer_forward_rel_diff"] <= cell["tolerance"]
        assert max(check["peer_grad_rel_diff"].values()) <= cell["tolerance"]
    for mode in bl.MODES:
        record = cell["modes"][mode]
        assert set(record["whole_ms"]) == {layout.name for layout in bl.LAYOUTS} | ({bl.PEER} if peer else set())
        assert all(ms > 0 for ms in record["whole_ms"].values()) and record["whole_ratio"][bl.BASE] == 1.0
        assert set(record["stages"]) == {layout.name for layout in bl.LAYOUTS}
        for stages in record["stages"].values():
            if DEVICE == "cpu":
                assert stages == {}
            else:
                assert {bl.GATE_UP, bl.DOWN, bl.KERNEL_SUM} <= set(stages), stages
    assert results["cells"][0]["check"]["ok"]
    md = (tmp_path / "layouts.md").read_text()
    assert "## Stages" in md and "| gpt-oss-20b | 1 | training |" in md
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-1].startswith("| gpt-oss-20b | 1 | training |") and printed[-1].endswith("| ok |")


def test_layouts_stage_mapping():
    """Kernel names -> stages: the two forward GEMMs (one kernel name) by their position in each call, the decode
    kernels by name, the backward kernels before any GEMM rule, a new variant by its substrings; dispatch and torch's
    fills are "other" quietly, a kernel no rule knows is "other" and listed."""
    import bench_layouts as bl

    assert bl.stage_of("_persistent_weight_grad_kernel") == ("weight_grad (dW)", True)
    assert bl.stage_of("_topk_weights_grad_kernel") == ("topk_weights_grad", True)
    assert bl.stage_of("_down_grad_dot_kernel") == ("down_grad (dA)", True)  # a variant the package may add
    assert bl.stage_of("_grouped_gemm_grad_kernel") == (bl.OTHER, False)  # "grad" never counts as a forward GEMM
    assert bl.stage_of("_decode_down_dot_kernel") == (bl.DOWN, True)
    assert bl.stage_of("void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>") == (bl.OTHER, True)
    assert bl.stage_of("_mystery_kernel") == (bl.OTHER, False)
    call = [("_dispatch_single_kernel", 2.0), ("_persistent_grouped_gemm_kernel", 10.0),
            ("_grouped_gemm_kernel", 20.0), ("_combine_kernel", 1.0), ("_down_grad_kernel", 30.0),
            ("_topk_weights_grad_kernel", 1.0), ("_gate_up_grad_kernel", 40.0), ("_gather_kernel", 3.0),
            ("_expert_weight_grad_kernel", 50.0), ("_mystery_kernel", 4.0)]
    stages, kernels, unmapped = bl.assign_stages(call * 2, 2)
    assert stages == {bl.GATE_UP: 10.0, bl.DOWN: 20.0, bl.OTHER: 10.0, "down_grad (dA)": 30.0,
                      "gate_up_grad (dX)": 40.0, "weight_grad (dW)": 50.0, "topk_weights_grad": 1.0,
                      bl.KERNEL_SUM: 161.0}
    assert unmapped == ["_mystery_kernel"]
    assert kernels["_grouped_gemm_kernel [down]"] == {"name": "_grouped_gemm_kernel", "stage": bl.DOWN, "us": 20.0,
                                                      "launches": 1.0}
    stages, _, _ = bl.assign_stages([("_grouped_gemm_kernel", 5.0)] * 3, 1)  # not two per call: not split
    assert stages == {bl.UNSPLIT: 15.0, bl.KERNEL_SUM: 15.0}
    decode = [("_decode_gate_up_kernel", 3.0), ("_decode_down_kernel", 2.0)]
    assert bl.assign_stages(decode, 1)[0] == {bl.GATE_UP: 3.0, bl.DOWN: 2.0, bl.KERNEL_SUM: 5.0}


def test_layouts_lay_out_and_back():
    """Each layout holds the reference values where fused_experts' docstring says (contiguous, as a checkpoint
    stores them), and to_reference maps its gradients back exactly; the check catches weights passed in the wrong
    layout."""
    import bench_layouts as bl
    import moe_dispatch as md

    E, H, F = 3, 8, 4
    w_gate_up, w_down, bias = torch.randn(E, 2 * F, H), torch.randn(E, H, F), torch.randn(E, 2 * F)
    for layout in bl.LAYOUTS:
        gu, d, b = bl.lay_out(layout, w_gate_up, w_down, bias)
        assert gu.is_contiguous() and d.is_contiguous() and b.is_contiguous()
        gate_rows = gu.transpose(1, 2) if layout.transposed else gu  # [E, 2F, H]
        gate, up = (gate_rows[:, 0::2], gate_rows[:, 1::2]) if layout.interleaved else (gate_rows[:, :F],
                                                                                        gate_rows[:, F:])
        assert torch.equal(gate, w_gate_up[:, :F]) and torch.equal(up, w_gate_up[:, F:])
        assert gu.shape == ((E, H, 2 * F) if layout.transposed else (E, 2 * F, H))
        assert torch.equal(d.transpose(1, 2) if layout.transposed else d, w_down)
        for name, laid, ref in (("w_gate_up", gu, w_gate_up), ("w_down", d, w_down), ("gate_up_bias", b, bias)):
            assert torch.equal(bl.to_reference(layout, name, laid), ref), (layout, name)
    # concatenated weights run as interleaved: far off the reference layout's output (what the check holds to)
    experts = bl.make_experts(dataclasses.replace(MODEL_SHAPES["gpt-oss-120b"], **bl.SMOKE_SIZES), torch.float32,
                              torch.device(DEVICE), 0, gpt_oss=True)
    x = torch.randn(1, 64, device=DEVICE)
    ids, weights = harness.random_routing(1, 4, 2, torch.device(DEVICE), 0)
    outs = []
    for layout in (bl.LAYOUTS[0], dataclasses.replace(bl.LAYOUTS[0], interleaved=True)):
        forward, _ = bl.layout_forward(experts, layout, x, ids, weights)
        with torch.no_grad():
            outs.append(forward())
    assert bl.rel_diff(outs[1], outs[0]) > TOLERANCE[torch.float32] * 100


# The MXFP4 benchmark (scripts/bench_mxfp4.py).


@needs_interpreter  # --cpu-smoke runs the kernels on CPU tensors
def test_bench_mxfp4_cpu_smoke(tmp_path, capsys):
    """--cpu-smoke on GPT-OSS-20B's routing at interpreter widths, T = 1 and 5: the package on MXFP4 weights and on
    their bf16 values agree with the float64 experts on the dequantized weights (transformers' experts too where
    transformers imports), the Hub peers, absent from --hub-dir, are skipped with the reason instead of failing the run,
    the decode floor follows the target's formula with R of the same run, the JSON and Markdown have their structure
    and name no machine path, and the short table is printed last."""
    import bench_mxfp4 as bm

    out = tmp_path / "out"
    results = bm.main(["--cpu-smoke", "--models", "gpt-oss-20b", "--tokens", "1,5", "--out", str(out),
                       "--hub-dir", str(tmp_path / "no-hub")])
    cells = results["cells"]
    assert [(c["model"], c["T"]) for c in cells] == [("gpt-oss-20b", 1), ("gpt-oss-20b", 5)]
    read = results["ceilings"]["read_bytes_per_s"]
    for c in cells:
        impls = c["impls"]
        assert set(impls) == set(bm.IMPLS)
        for name in ("mxfp4", "bf16", "mxfp4_portable"):
            assert "error" not in impls[name] and impls[name]["ok"], impls[name]
            assert impls[name]["rel_err"] <= bm.TOLERANCE and impls[name]["us"] > 0
        hf = impls["hf_grouped_mm"]
        assert hf.get("ok") or hf.get("skipped"), hf  # transformers' experts compute the same function
        for name in bm.HUB_IMPLS:
            assert impls[name]["skipped"].startswith("needs a CUDA device"), impls[name]
        assert 1 <= c["experts_hit"] <= min(c["T"] * c["top_k"], c["E"])
        assert c["mxfp4_bytes"] == bm.mxfp4_bytes(bm.model_shape("gpt-oss-20b", True), c["experts_hit"])
        assert c["target"] == "decode"
        assert c["floor_us"] == pytest.approx(1.15 * c["mxfp4_bytes"] / read * 1e6 + 10)
        assert c["mxfp4_over_floor"] == pytest.approx(impls["mxfp4"]["us"] / c["floor_us"])
        assert c["mxfp4_over_bf16"] > 0
    data = json.loads((out / "mxfp4.json").read_text())
    assert set(data) == {"meta", "shapes", "ceilings", "cells"}
    assert str(tmp_path) not in json.dumps(data["meta"]) and str(ROOT) not in json.dumps(data["meta"])
    md = (out / "mxfp4.md").read_text()
    assert "## Short table" in md and "| gpt-oss-20b | 5 |" in md
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-1].startswith("| gpt-oss-20b | 5 | ") and printed[-1].endswith("| ok |"), printed[-1]


@needs_interpreter
@pytest.mark.parametrize("choice,decodes_first", [("buffer", True), ("loads", False)])
def test_bench_mxfp4_prefill_choice(choice, decodes_first, tmp_path, monkeypatch):
    """--mxfp4-prefill forces the planner's choice for the A/B: "buffer" decodes the weights once per call
    (gemm/mxfp4_dequant.py) even at T = 5, "loads" never does; both agree with the float64 experts."""
    import bench_mxfp4 as bm

    from moe_dispatch import moe

    calls = []
    real = moe.dequantize_mxfp4_experts
    monkeypatch.setattr(moe, "dequantize_mxfp4_experts", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.setenv("MOE_DISPATCH_MXFP4_PREFILL", "auto")  # main sets it for its run; restored after the test
    results = bm.main(["--cpu-smoke", "--models", "gpt-oss-20b", "--tokens", "5", "--impls", "mxfp4,bf16",
                       "--mxfp4-prefill", choice, "--out", str(tmp_path / "out"), "--no-hub"])
    (cell,) = results["cells"]
    assert cell["impls"]["mxfp4"]["ok"], cell["impls"]["mxfp4"]
    assert bool(calls) == decodes_first, calls


@pytest.mark.parametrize("before", [None, "1", "auto"])
def test_bench_mxfp4_portable_impl_restores_the_engine_switch(before, monkeypatch):
    """The portable implementation runs its call with MOE_DISPATCH_GLUON_MXFP4=0 and leaves the switch as it found it:
    the other implementations of the run (the engine's, captured into CUDA graphs after every first call) read it."""
    import bench_mxfp4 as bm

    if before is None:
        monkeypatch.delenv(bm.GLUON_MXFP4_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(bm.GLUON_MXFP4_VARIABLE, before)
    seen = []

    class Kernel:
        @staticmethod
        def fused_experts(*args, **kwargs):
            seen.append(os.environ.get(bm.GLUON_MXFP4_VARIABLE))

    class Weights:
        @staticmethod
        def call_kwargs():
            return {}

    inputs = type("Inputs", (), dict(x=None, ids=None, weights=None))
    call = bm.portable_impl(Kernel, Weights).make(inputs)
    call()
    call()
    assert seen == ["0", "0"] and os.environ.get(bm.GLUON_MXFP4_VARIABLE) == before


def test_bench_mxfp4_flags_a_switch_that_changed_between_calls(monkeypatch):
    """Each implementation's calls note the engine's switch as they find it; a cell whose implementation found it
    changed (its timed graphs then ran something other than its checked first call) says so in its checks."""
    import bench_mxfp4 as bm

    monkeypatch.setenv(bm.GLUON_MXFP4_VARIABLE, "1")
    seen, steady = [], []
    changed_fn, steady_fn = bm.noting_switch(lambda: None, seen), bm.noting_switch(lambda: None, steady)
    changed_fn()
    steady_fn()
    monkeypatch.delenv(bm.GLUON_MXFP4_VARIABLE)
    changed_fn()
    changed_fn()
    assert seen == ["1", None] and steady == ["1"]
    cell = {"impls": {"mxfp4": {"engine_switch_seen": seen, "rel_err": 0.0, "ok": True},
                      "bf16": {"engine_switch_seen": steady, "rel_err": 0.0, "ok": True}}}
    assert bm.checks_text(cell) == f"mxfp4 ran with {bm.GLUON_MXFP4_VARIABLE} '1' then None"
    cell["impls"]["mxfp4"]["engine_switch_seen"] = ["1"]
    assert bm.checks_text(cell) == "ok"


def test_bench_mxfp4_accounting_layouts_and_peers(tmp_path, monkeypatch):
    """scripts/bench_mxfp4.py's pieces: the decode floor (1.15 x (MXFP4 + scale bytes of the experts hit) / R + 10 us)
    and the prefill ratio (MXFP4 / bf16 <= 1.1 from T = 1024, the per-pair ratio preferred), the weights it builds
    (its bf16 copy is the float64 dequantization exactly), finegrained-fp8's layout of them (the same values, gate
    rows then up rows), its float64 reference a few experts at a time (= all at once), and the Hub peers' loading through
    LOCAL_KERNELS + get_kernel from --hub-dir (a source tree served as a local build, a Hub-layout kernel repository
    loaded as it is; one that fails to load is reported, not raised; a missing one says how to get it)."""
    import bench_mxfp4 as bm

    import moe_dispatch as md
    from moe_dispatch import reference

    shape = MODEL_SHAPES["gpt-oss-120b"]
    values = 3 * 2880 * 2880
    assert bm.mxfp4_bytes(shape, 4) == 4 * (values // 2 + values // 32)
    ceilings = {"read_bytes_per_s": 4e12}
    decode = bm.judge(1, 4, shape, {"mxfp4": 30.0, "bf16": 60.0}, ceilings)
    assert decode["floor_us"] == pytest.approx(1.15 * bm.mxfp4_bytes(shape, 4) / 4e12 * 1e6 + 10)
    assert decode["met"] == (30.0 <= decode["floor_us"]) and decode["mxfp4_over_bf16"] == 0.5
    prefill = bm.judge(4096, 128, shape, {"mxfp4": 105.0, "bf16": 100.0}, ceilings, paired_ratio=1.12)
    assert prefill["target"] == "prefill" and prefill["mxfp4_over_bf16"] == 1.12 and prefill["met"] is False
    assert bm.judge(1024, 128, shape, {"mxfp4": 105.0, "bf16": 100.0}, ceilings)["met"] is True
    assert "target" not in bm.judge(128, 100, shape, {"mxfp4": 1.0, "bf16": 1.0}, ceilings)

    small = bm.model_shape("gpt-oss-20b", True)
    w = harness.make_mxfp4_weights(small, torch.device(DEVICE), 0, md)
    assert torch.equal(w.dq_gu.double(), reference.dequantize_mxfp4_ref(w.gu_blocks, w.gu_scales))
    assert torch.equal(w.dq_d.double(), reference.dequantize_mxfp4_ref(w.d_blocks, w.d_scales))
    gu, gu_scales, down, down_scales = bm.fg_weights(w)
    F = small.ffn
    theirs = md.dequantize_experts_mxfp4(gu.view(torch.uint8), gu_scales, torch.bfloat16)
    assert gu.dtype == torch.int8 and gu.shape == (small.num_experts, 2 * F, small.hidden // 2)
    assert torch.equal(theirs[:, :F], w.dq_gu[:, 0::2]) and torch.equal(theirs[:, F:], w.dq_gu[:, 1::2])
    assert torch.equal(md.dequantize_experts_mxfp4(down.view(torch.uint8), down_scales, torch.bfloat16), w.dq_d)
    inp = bm.make_inputs(small, 5, torch.device(DEVICE), 0)
    whole = reference.fused_experts_ref(inp.x, w.dq_gu, w.dq_d, inp.ids, inp.weights, activation="swiglu_oai",
                                        interleaved=True, gate_up_bias=w.gu_bias, down_bias=w.d_bias)
    chunked = harness.mxfp4_reference(w, inp.x, inp.ids, inp.weights, chunk=1)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-15)

    # The Hub peers load through LOCAL_KERNELS + kernels.get_kernel(repo_id, version=N), from DIR/<repository name>.
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)  # load_peer appends its entries; restored after the test
    hub = tmp_path / "hub"
    tk, fg = bm.HUB_IMPLS["tk_matmul_ogs"], bm.HUB_IMPLS["fg_mxfp4"]
    assert (tk.repo_id, tk.version, fg.repo_id, fg.version) == (
        "kernels-community/gpt-oss-triton-kernels", 1, "kernels-community/finegrained-fp8", 4)  # transformers' asks
    source = hub / "gpt-oss-triton-kernels"  # a source tree: served as a local build first
    (source / "torch-ext" / "gpt_oss_triton_kernels").mkdir(parents=True)
    (source / "torch-ext" / "gpt_oss_triton_kernels" / "__init__.py").write_text(
        "raise ImportError('built for another Triton')\n")
    assert bm.find_peer(hub, tk) == (source, "source") and bm.find_peer(hub, fg) == (None, None)
    module, why = bm.load_peer(hub, tk)
    assert module is None and "get_kernel('kernels-community/gpt-oss-triton-kernels', version=1)" in why, why
    assert "built for another Triton" in why and "kernels-community/gpt-oss-triton-kernels=" in os.environ["LOCAL_KERNELS"]
    module, why = bm.load_peer(hub, fg)
    assert module is None and why.startswith("no finegrained-fp8 under --hub-dir") and "hf download" in why, why
    variant = hub / "finegrained-fp8" / "build" / PREFERRED_VARIANT  # the kernel repository as the Hub serves it
    variant.mkdir(parents=True)
    (variant / "__init__.py").write_text("SERVED = 'from --hub-dir'\n")
    (variant / "metadata.json").write_text(json.dumps({
        "name": "finegrained-fp8", "id": "_finegrained_fp8_bench_smoke", "version": 4, "license": "Apache-2.0",
        "python-depends": [], "backend": {"type": PREFERRED_VARIANT.removeprefix("torch-")}}))
    assert bm.find_peer(hub, fg) == (hub / "finegrained-fp8", "build")
    module, why = bm.load_peer(hub, fg)
    assert why is None and module.SERVED == "from --hub-dir" and module.__name__ == "_finegrained_fp8_bench_smoke"


# The end-to-end generate benchmark's MXFP4 mode (benchmarks/generate_e2e.py --quantize mxfp4).


def test_generate_e2e_mxfp4_arguments_and_blocks():
    """--quantize mxfp4's CPU defaults (GPT-OSS only, all three implementations, the dequantized model as reference, a
    16-token prefill, no training) and what it refuses; the scale code follows --init-std."""
    import generate_e2e as ge

    args = ge.parse_args(["--device", "cpu", "--quantize", "mxfp4"])
    assert args.models == list(ge.MXFP4_MODELS) and args.impls == list(ge.MXFP4_IMPLS)
    assert args.reference == ge.MXFP4_DEQUANTIZED and args.prefill_tokens == 16 and not args.train
    assert ge.parse_args(["--device", "cpu"]).prefill_tokens == 0  # off outside the MXFP4 mode
    for refused in (["--train"], ["--models", "qwen3-30b-a3b"], ["--impls", "moe_dispatch"],
                    ["--reference", "eager"], ["--prefill-tokens", "-1"]):
        with pytest.raises(SystemExit):
            ge.parse_args(["--device", "cpu", "--quantize", "mxfp4", *refused])
    with pytest.raises(SystemExit):
        ge.parse_args(["--device", "cpu", "--hub-dir", "somewhere"])  # the flag needs the MXFP4 mode
    assert (ge.mxfp4_scale_code(0.02), ge.mxfp4_scale_code(0.1)) == (120, 122)


@needs_interpreter  # the package's MXFP4 kernels on CPU tensors (the dequantized variant is made by them)
def test_generate_e2e_mxfp4_blocks_swap():
    """On a tiny model the package's and the dequantized blocks swap in and out around the same router, each with the
    quantizer loading would give it; a peer that did not load is skipped with its reason."""
    import generate_e2e as ge

    args = ge.parse_args(["--device", "cpu", "--quantize", "mxfp4"])
    device = torch.device("cpu")
    model, shape = ge.build_mxfp4_model(ge.SPECS["gpt-oss-20b"], args, device, torch.float32)
    package_quantizer = model.hf_quantizer
    impls = [ge.MXFP4_PACKAGE, ge.MXFP4_DEQUANTIZED, ge.MXFP4_PEER]
    variants = ge.mxfp4_variants(model, impls, device, torch.float32, (None, {"status": "skipped: not here"}))
    assert variants.status() == {ge.MXFP4_PACKAGE: "ready", ge.MXFP4_DEQUANTIZED: "ready",
                                 ge.MXFP4_PEER: "skipped: not here"}
    setattr(model, ge.VARIANTS_ATTRIBUTE, variants)
    assert ge.skipped_implementations(model) == {ge.MXFP4_PEER: "not here"}
    (name,) = variants.blocks[ge.MXFP4_PACKAGE]
    ours = model.get_submodule(name)
    ge.use_implementation(model, ge.MXFP4_DEQUANTIZED)
    dense = model.get_submodule(name)
    assert type(dense.experts).__name__ == "GptOssExperts" and dense.router is ours.router
    assert model.hf_quantizer is None and model.config._experts_implementation == "eager"
    assert dense.experts.gate_up_proj.shape == (shape.num_experts, shape.hidden, 2 * shape.ffn)
    ge.use_implementation(model, ge.MXFP4_PACKAGE)
    assert model.get_submodule(name) is ours and model.hf_quantizer is package_quantizer
    with pytest.raises(RuntimeError, match="not here"):
        ge.use_implementation(model, ge.MXFP4_PEER)


@needs_interpreter  # the package's MXFP4 kernels on CPU tensors
def test_generate_e2e_mxfp4_cpu_smoke(tmp_path, kernel_calls):
    """The MXFP4 mode's smoke run on tiny GPT-OSS-20B: the package's kernel ran, its greedy tokens, prefill next token
    and logits equal transformers' eager loop on the dequantized experts (fp32), transformers' MXFP4 path is skipped in
    every cell with the reason (GPU-only) instead of failing the run, and the JSON / Markdown say so, naming no
    machine path."""
    import generate_e2e as ge

    local_kernels = os.environ.get("LOCAL_KERNELS")
    out = tmp_path / "out"
    results = ge.main(["--device", "cpu", "--quantize", "mxfp4", "--models", "gpt-oss-20b", "--out", str(out),
                       "--hub-dir", str(tmp_path / "hub")])
    assert kernel_calls, "the package's fused_experts never ran"
    assert os.environ.get("LOCAL_KERNELS") == local_kernels  # a CPU run loads no peer
    assert (results["package_impl"], results["default_impl"]) == (ge.MXFP4_PACKAGE, ge.MXFP4_PEER)
    record = results["models"]["gpt-oss-20b"]
    assert record["moe_layers"] == 1 and record["quantization"]["mxfp4_experts"] == 1
    assert 118 <= record["quantization"]["scale_codes"][0] <= record["quantization"]["scale_codes"][1] <= 123
    assert record["implementations"][ge.MXFP4_PEER].startswith("skipped: needs a CUDA device")
    assert record["block_check"][ge.MXFP4_DEQUANTIZED] < 1e-5  # fp32: the same values, dequantized

    cells = {(c["batch"], c["impl"]): c for c in results["decode"]}
    assert set(cells) == {(b, i) for b in (1, 2) for i in ge.MXFP4_IMPLS}
    for (batch, impl), c in cells.items():
        if impl == ge.MXFP4_PEER:
            assert c["skipped"].startswith("needs a CUDA device") and "tokens_per_s" not in c, c
            continue
        assert "error" not in c and c["generate_s"] > 0, c
        assert c["rows_equal"] == 1.0 and c["first_diff"] is None, c  # fp32: the dequantized eager loop's tokens
    prefill = {c["impl"]: c for c in results["prefill"]}
    assert prefill[ge.MXFP4_PACKAGE]["prefill_ms"] > 0 and prefill[ge.MXFP4_PACKAGE]["next_token_equal"]
    assert prefill[ge.MXFP4_PACKAGE]["tokens"] == 16 and "skipped" in prefill[ge.MXFP4_PEER]
    for c in results["logits"]:
        if c["impl"] == ge.MXFP4_PACKAGE:
            assert c["max_abs_diff"] <= 1e-4 * c["ref_max_abs"] and c["rows_flipped"] == 0, c
        elif c["impl"] == ge.MXFP4_PEER:
            assert c["skipped"].startswith("needs a CUDA device"), c

    data = json.loads((out / "generate_e2e.json").read_text())
    assert data["meta"]["mxfp4_peer"]["status"].startswith("skipped: needs a CUDA device")
    assert "gpt-oss-triton-kernels under --hub-dir" in data["meta"]["mxfp4_peer"]["status"]
    assert str(tmp_path) not in json.dumps(data["meta"])
    md_text = (out / "generate_e2e.md").read_text()
    assert "| gpt-oss-20b | 1 | eager | transformers_mxfp4 | skipped: needs a CUDA device" in md_text
    assert "Prefill: one forward of a 16-token prompt" in md_text


# The training benchmark's frozen mode (scripts/bench_train.py --frozen).


def test_bench_train_frozen_arguments():
    """--frozen's models: each format's defaults, or the --models it takes (MXFP4 only GPT-OSS's); refused: an unknown
    format, a model no format takes, --cpu-smoke without --frozen (the bf16 table's peers need a GPU)."""
    import bench_train as bt

    args = bt.parse_args(["--frozen", "fp8,mxfp4"])
    assert args.frozen_runs == [("fp8", name) for name in bt.FROZEN_MODELS["fp8"]] + [
        ("mxfp4", name) for name in bt.FROZEN_MODELS["mxfp4"]]
    assert args.tokens == bt.TOKENS and args.device == "cuda"
    args = bt.parse_args(["--frozen", "mxfp4,fp8", "--models", "gpt-oss-20b,mixtral-8x7b", "--cpu-smoke"])
    assert args.frozen_runs == [("mxfp4", "gpt-oss-20b"), ("fp8", "gpt-oss-20b"), ("fp8", "mixtral-8x7b")]
    assert args.tokens == bt.SMOKE_TOKENS and args.device == "cpu"
    assert bt.parse_args([]).models == bt.MODELS and bt.parse_args([]).frozen is None
    for refused in (["--frozen", "int4"], ["--frozen", ""], ["--frozen", "mxfp4", "--models", "mixtral-8x7b"],
                    ["--cpu-smoke"]):
        with pytest.raises(SystemExit):
            bt.parse_args(refused)


@needs_interpreter  # --cpu-smoke runs the kernels on CPU tensors
def test_bench_train_saves_every_cell_and_keeps_its_budget(tmp_path, capsys, monkeypatch):
    """train.json holds every cell measured before the next one starts (a run stopped from outside keeps them), and
    past --budget-s no cell starts: the rest are listed as not started, in the JSON and the table."""
    import functools

    import bench_train as bt

    monkeypatch.setattr(harness, "WallTimer", functools.partial(harness.WallTimer, repeats=1))
    measure = bt.frozen_cell
    saved_before = []

    def measured_then_out_of_time(args, *rest):
        saved_before.append(json.loads((tmp_path / "train.json").read_text())["frozen"]
                            if (tmp_path / "train.json").exists() else None)
        cell = measure(args, *rest)
        args.deadline = 0.0  # the budget runs out during the first cell
        return cell

    monkeypatch.setattr(bt, "frozen_cell", measured_then_out_of_time)
    results = bt.main(["--frozen", "fp8", "--cpu-smoke", "--budget-s", "3600", "--out", str(tmp_path)])
    cells = results["frozen"]
    assert saved_before == [None] and "skipped" not in cells[0] and cells[0]["grad_ok"]
    assert len(cells) == len(bt.FROZEN_MODELS["fp8"]) * len(bt.SMOKE_TOKENS) > 1
    assert all(c["skipped"] == "budget 3600 s" for c in cells[1:]), cells[1:]
    assert json.loads((tmp_path / "train.json").read_text())["frozen"] == cells
    table = (tmp_path / "train.md").read_text()
    assert table.count("| ok |") == 1 and table.count("not started: budget 3600 s") == len(cells) - 1
    capsys.readouterr()


@needs_interpreter  # --cpu-smoke runs the kernels on CPU tensors
def test_bench_train_frozen_cpu_smoke(tmp_path, capsys, monkeypatch):
    """--frozen fp8,mxfp4 --cpu-smoke: every default (format, model) cell ran both steps (frozen quantized weights and
    their bf16 values), the quantized step's d x and d topk_weights agree with the bf16 step's within the bf16
    tolerance, no weight tensor required or got a gradient and every backward was asked for d x and d topk_weights
    only, memory is None on the CPU, and train.json / train.md hold the frozen section, printed last. Plans off, so
    that every backward runs its launcher in full (a replay would skip the recorded allocation); the CPU timer's
    repeats cut to one (the times are plumbing, not measurements)."""
    import functools

    import bench_train as bt

    from moe_dispatch.experts import autograd

    monkeypatch.setattr(harness, "WallTimer", functools.partial(harness.WallTimer, repeats=1))
    monkeypatch.setenv("MOE_DISPATCH_PLANS", "0")
    asked = []
    allocate = autograd._allocate_grads

    def recording(*args, **kwargs):
        *_, needs = args
        asked.append({name for name, need in zip(autograd._GRAD_INPUTS, needs) if need})
        return allocate(*args, **kwargs)

    monkeypatch.setattr(autograd, "_allocate_grads", recording)
    results = bt.main(["--frozen", "fp8,mxfp4", "--cpu-smoke", "--out", str(tmp_path)])
    cells = results["frozen"]
    expected = [(fmt, name, T) for fmt in bt.FROZEN_FORMATS for name in bt.FROZEN_MODELS[fmt] for T in bt.SMOKE_TOKENS]
    assert [(c["format"], c["model"], c["T"]) for c in cells] == expected
    for c in cells:
        assert (c["E"], c["top_k"], c["H"], c["F"]) == (4, 2, 64, 32), c
        for side in ("quantized", "bf16"):
            assert "error" not in c[side] and c[side]["ms"] > 0 and c[side]["peak_gib"] is None, c
        assert c["quantized_over_bf16"] == pytest.approx(c["quantized"]["ms"] / c["bf16"]["ms"])
        assert set(c["grad_rel_diff"]) == {"x", "topk_weights"}
        assert c["grad_ok"] and max(c["grad_rel_diff"].values()) <= TOLERANCE[torch.bfloat16], c
        assert c["weights_with_grad"] == [], c
    assert asked and all(needs == {"x", "topk_weights"} for needs in asked), asked
    data = json.loads((tmp_path / "train.json").read_text())
    assert data["rows"] == [] and len(data["frozen"]) == len(expected)
    assert data["frozen_meta"]["tolerance"] == TOLERANCE[torch.bfloat16] and str(tmp_path) not in json.dumps(data)
    md_text = (tmp_path / "train.md").read_text()
    assert md_text.startswith("## Frozen quantized experts") and md_text.count("| ok |") == len(expected)
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-1].startswith("| mxfp4 | gpt-oss-20b | 5 | ") and printed[-1].endswith("| ok |"), printed[-1]
