#!/usr/bin/env python3
"""Draw the performance figure of the README and docs/performance.md from the results files, as SVG.

    python3 docs/plot.py            # writes docs/results/h200-forward-v12.svg
    python3 docs/plot.py --check    # exit status 1 when that file is not what the data gives (tests/test_docs.py)

The figure: bf16 `fused_experts` on one H200 beside vLLM's Triton MoE kernel, measured in the same run by the
same-run peer harness (h200-peers-bf16-v12.json), one panel per model shape, time over the floor max(bytes / R,
FLOPs / P) against T, with the R and P that run measured. Four series: moe_dispatch's `fused_experts`, vLLM's
fused_moe_kernel (its two GEMM launches only), vLLM's whole forward (those GEMMs, its activation and the sum of each
token's k rows; the token alignment stays outside) and transformers' grouped_mm path. Every time is a CUDA-graph
replay of unrolled calls with no L2 flush, the paths alternating round by round. Standard library only, and
deterministic: the same data gives the same bytes.
"""

import argparse
import json
import math
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PEERS = RESULTS / "h200-peers-bf16-v12.json"
OUT = RESULTS / "h200-forward-v12.svg"

MODELS = [  # (key in the results, panel title)
    ("mixtral-8x7b", "Mixtral-8x7B (E 8, top_k 2)"),
    ("mixtral-8x22b", "Mixtral-8x22B (E 8, top_k 2)"),
    ("qwen2-57b", "Qwen2-57B-A14B (E 64, top_k 8)"),
    ("qwen3-30b", "Qwen3-30B-A3B (E 128, top_k 8)"),
    ("deepseek-v3", "DeepSeek-V3 routed (E 256, top_k 8)"),
    ("gpt-oss-120b", "GPT-OSS-120B-like (E 128, top_k 4)"),
]
SERIES = [  # (key in a cell's results, name in the legend, colour, dash pattern, marker), in the order load() returns
    ("project_fe", "moe_dispatch fused_experts", "#1f5fa8", "", "circle"),
    ("vllm_gemm", "vLLM fused_moe_kernel, its two GEMMs", "#c0392b", "6 3", "square"),
    ("vllm_full", "vLLM whole forward (GEMMs, silu*up, sum over k)", "#e59866", "3 2", "ring"),
    ("grouped_mm", "transformers grouped_mm path", "#6b6b6b", "2 3", "triangle"),
]
Y_MIN, Y_MAX = 0.8, 7.0  # time / floor, log scale
Y_TICKS = (1, 1.5, 2, 3, 4, 6)

WIDTH, HEIGHT = 960, 640
COLS, ROWS = 3, 2
LEFT, TOP, RIGHT, BOTTOM = 56, 92, 16, 110  # figure margins around the grid of panels
GAP_X, GAP_Y = 38, 52  # between panels
FONT = 'font-family="DejaVu Sans, Arial, sans-serif"'


def load(peers_path=PEERS):
    """{model: (tokens, [fused_experts / floor], [vLLM GEMMs / floor], [vLLM whole / floor], [grouped_mm / floor])},
    the run's meta and its ceilings."""
    with open(peers_path) as f:
        run = json.load(f)
    data = {}
    for model, _ in MODELS:
        cells = sorted((c for c in run["cells"] if c["model"] == model), key=lambda c: c["T"])
        if not cells:
            raise KeyError(f"{peers_path.name} has no cell for {model}")
        series = [[c["results"][key]["us"] / c["floor_us"] for c in cells] for key, *_ in SERIES]
        data[model] = ([c["T"] for c in cells], *series)
    return data, run["meta"], run["ceilings"]


def _fmt(v):
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _label_t(t):
    return f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)


def _marker(kind, x, y, colour):
    if kind == "circle":
        return f'<circle cx="{_fmt(x)}" cy="{_fmt(y)}" r="3.2" fill="{colour}"/>'
    if kind == "ring":
        return f'<circle cx="{_fmt(x)}" cy="{_fmt(y)}" r="2.6" fill="white" stroke="{colour}" stroke-width="1.2"/>'
    if kind == "square":
        return (f'<rect x="{_fmt(x - 3)}" y="{_fmt(y - 3)}" width="6" height="6" fill="white" stroke="{colour}" '
                f'stroke-width="1.4"/>')
    points = f"{_fmt(x)},{_fmt(y - 3.6)} {_fmt(x - 3.4)},{_fmt(y + 2.6)} {_fmt(x + 3.4)},{_fmt(y + 2.6)}"
    return f'<polygon points="{points}" fill="{colour}"/>'


def render(data, meta, ceilings):
    panel_w = (WIDTH - LEFT - RIGHT - (COLS - 1) * GAP_X) / COLS
    panel_h = (HEIGHT - TOP - BOTTOM - (ROWS - 1) * GAP_Y) / ROWS
    log_lo, log_hi = math.log(Y_MIN), math.log(Y_MAX)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{LEFT}" y="26" {FONT} font-size="16" font-weight="bold">bf16 fused_experts beside vLLM on one '
        'NVIDIA H200, same run: time over the floor (lower is better)</text>',
        f'<text x="{LEFT}" y="46" {FONT} font-size="11.5" fill="#333">floor = max(bytes / R, FLOPs / P); '
        f'R {ceilings["read_bytes_per_s"] / 1e12:.2f} TB/s, P {ceilings["matmul_flops_per_s"] / 1e12:.0f} TFLOP/s '
        f'measured in the run (commit {meta["project_commit"][:7]}, {meta["started"][:10]}, triton {meta["triton"]}, '
        f'{meta["vllm"].split(" (")[0]}); balanced random routing</text>',
        f'<text x="{LEFT}" y="62" {FONT} font-size="11.5" fill="#333">every path: CUDA-graph replays of unrolled '
        'calls, no L2 flush, the paths alternating round by round; vLLM: the best of its tuned table and a sweep</text>',
    ]
    for index, (model, title) in enumerate(MODELS):
        tokens, *series = data[model]
        x0 = LEFT + (index % COLS) * (panel_w + GAP_X)
        y0 = TOP + (index // COLS) * (panel_h + GAP_Y)

        def px(i):
            return x0 + 10 + i * (panel_w - 20) / (len(tokens) - 1)

        def py(v):
            v = min(max(v, Y_MIN), Y_MAX)
            return y0 + panel_h - (math.log(v) - log_lo) / (log_hi - log_lo) * panel_h

        out.append(f'<rect x="{_fmt(x0)}" y="{_fmt(y0)}" width="{_fmt(panel_w)}" height="{_fmt(panel_h)}" '
                   'fill="none" stroke="#999" stroke-width="0.8"/>')
        out.append(f'<text x="{_fmt(x0 + 4)}" y="{_fmt(y0 - 7)}" {FONT} font-size="12" font-weight="bold">'
                   f'{title}</text>')
        for tick in Y_TICKS:
            y = py(tick)
            width = "1" if tick == 1 else "0.5"
            out.append(f'<line x1="{_fmt(x0)}" y1="{_fmt(y)}" x2="{_fmt(x0 + panel_w)}" y2="{_fmt(y)}" '
                       f'stroke="#ddd" stroke-width="{width}"/>')
            if index % COLS == 0:
                out.append(f'<text x="{_fmt(x0 - 5)}" y="{_fmt(y + 4)}" {FONT} font-size="10.5" '
                           f'text-anchor="end">{_fmt(tick)}x</text>')
        for i, t in enumerate(tokens):
            out.append(f'<text x="{_fmt(px(i))}" y="{_fmt(y0 + panel_h + 14)}" {FONT} font-size="10.5" '
                       f'text-anchor="middle">{_label_t(t)}</text>')
        for (_, name, colour, dash, marker), values in zip(SERIES, series):
            points = " ".join(f"{_fmt(px(i))},{_fmt(py(v))}" for i, v in enumerate(values))
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="1.6"{dash_attr}/>')
            out += [_marker(marker, px(i), py(v), colour) for i, v in enumerate(values)]
        if index // COLS == ROWS - 1:
            out.append(f'<text x="{_fmt(x0 + panel_w / 2)}" y="{_fmt(y0 + panel_h + 30)}" {FONT} font-size="11" '
                       'text-anchor="middle">tokens T</text>')
    for number, (_, name, colour, dash, marker) in enumerate(SERIES):
        x = LEFT + (number % 2) * 430
        legend_y = HEIGHT - 40 + (number // 2) * 20
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{x}" y1="{legend_y - 4}" x2="{x + 28}" y2="{legend_y - 4}" stroke="{colour}" '
                   f'stroke-width="1.6"{dash_attr}/>')
        out.append(_marker(marker, x + 14, legend_y - 4, colour))
        out.append(f'<text x="{x + 34}" y="{legend_y}" {FONT} font-size="11.5">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help=f"only compare with {OUT.name}; exit 1 if it differs")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    svg = render(*load())
    if args.check:
        current = args.out.read_text() if args.out.is_file() else None
        if current != svg:
            print(f"{args.out} is not what {PEERS.name} gives: run python3 docs/plot.py",
                  file=sys.stderr)
            return 1
        return 0
    args.out.write_text(svg)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
