"""Agreement with the references (`moe_dispatch.reference` names them all): the tolerance table `TOLERANCE`,
`relative_error`, `assert_close` and the routing agreement of half-precision routers. Plain torch, nothing else.
"""

import torch


# Agreement with the references: one tolerance table and one comparison for every test and benchmark (the tests
# import them through tests/helpers.py; scripts/ and the Hub benchmark from here).
#
# TOLERANCE bounds the norm-wise relative error ||out - ref|| / ||ref|| by the dtype of the inputs. It is sized for
# the op with the most roundings, the MoE forward: the [T*k, F] intermediate, the weighted [T*k, H] expert rows and
# the output are each rounded to the input dtype once and everything else accumulates in fp32, so its error is a few
# unit roundoffs u (bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4; tests/cases.py's forward cases measure bf16 9e-3 = 2.3u
# and fp16 4e-4 = 0.8u), and the bound is 5u for both half precisions. fp32 only reorders fp32 sums (2e-7 measured);
# 1e-4 leaves room for a GPU's fp32 dots over K up to 16k and still catches a 0.1% error in the routing weights
# (4e-4). tf32, when torch allows it, is not held to this row. float64 inputs (binned copies) only reorder float64
# sums. Ops that round less than the forward (the binned copies round once) pass far inside these bounds; their
# tests add exact checks of their own (integers, exact zeros). The benchmarks (scripts/bench*.py, the Hub benchmark)
# hold real model sizes to the same table.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-4, torch.float16: 2.5e-3, torch.bfloat16: 2e-2}


def relative_error(out, ref):
    """||out - ref|| / ||ref|| in float64; NaN when `out` is not finite."""
    out, ref = out.detach().double(), ref.detach().double().to(out.device)
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, dtype=None, what="output", *, exact_zeros=False, tolerance=None):
    """out within TOLERANCE[dtype] (default: out's dtype; `tolerance` overrides) of ref by RMS relative error; never
    NaN or inf.

    On failure the message gives the RMS and the max relative error and the worst element (index, got, expected).
    exact_zeros: where ref is exactly zero (dropped, unused, padding), out must be exactly zero too."""
    dtype = out.dtype if dtype is None else dtype
    tolerance = TOLERANCE[dtype] if tolerance is None else tolerance
    out = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    bad = ~torch.isfinite(out)
    assert not bad.any(), f"{what}: non-finite values at {bad.nonzero()[:5].tolist()} (unwritten?)"
    if exact_zeros:
        stray = (ref == 0) & (out != 0)
        assert not stray.any(), f"{what}: nonzero where the reference is zero at {stray.nonzero()[:5].tolist()}"
    if not out.numel():
        return
    diff = (out - ref).abs()
    rms_rel = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
    max_rel = (diff.max() / ref.abs().max().clamp_min(1e-30)).item()
    worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    assert rms_rel <= tolerance, (
        f"{what}: rms rel err {rms_rel:.3e} > {tolerance:.1e} ({dtype}); max rel err {max_rel:.3e}, worst at {worst}: "
        f"got {out[worst].item():.6g}, expected {ref[worst].item():.6g}")


# Routing in half precision may pick another expert where two scores are within rounding of each other; checks of
# a kernel's routing against moe_router_ref ask for this share of tokens with exactly the reference's k experts.
ROUTING_AGREEMENT_MIN = 0.99


def routing_agreement(ids, ref_ids):
    """Share of tokens whose set of k experts equals the reference's."""
    ids, ref_ids = ids.detach().long().cpu(), ref_ids.detach().long().cpu()
    return (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1).float().mean().item()
