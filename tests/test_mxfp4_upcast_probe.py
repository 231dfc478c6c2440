"""benchmarks/mxfp4_upcast_probe.py, the probe of the MXFP4 weight upcast in registers (not part of the package): its
grouped GEMM against float64 on small odd sizes (an empty expert, ragged rows, a masked column tile and K step) in
every decode and operand order that runs here (the interpreter runs no PTX and computes bf16 dots wrongly: fp32 rows,
the fp32 decodes; a GPU: bf16 rows, every decode), and on a GPU its bf16x2 decode of every byte bit for bit."""

import pytest
import torch
from helpers import DEVICE, ON_GPU, needs_gpu

import mxfp4_dot_scaled_probe as dot_scaled_probe
import mxfp4_upcast_probe as probe

CONFIGS = [probe.UpcastConfig(swap, 16, 64, 64, decode=decode) for decode in probe.DECODES for swap in (True, False)
           if ON_GPU or not decode.startswith("bf16x2")]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("counts,N,K,why", dot_scaled_probe.SMALL_CASES, ids=["ragged", "even-k"])
def test_grouped_gemm_matches_float64(config, counts, N, K, why, poison_empty):
    from moe_dispatch.reference import assert_close

    E, M = len(counts), sum(counts)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    a = torch.randn(M, K, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    blocks, scales = dot_scaled_probe._mxfp4_weight(E, N, K, DEVICE, 1)
    offsets = dot_scaled_probe._offsets(counts, DEVICE)
    stored = probe.prepare_bytes(blocks) if "prepared" in config.decode else blocks
    out = probe.upcast_grouped_gemm(a, stored, scales, offsets, config)
    assert_close(out, dot_scaled_probe._reference(a, blocks, scales, offsets), dtype, what=f"{config.name}: {why}")


@needs_gpu
def test_prepared_order_puts_each_threads_bytes_together():
    """Byte 4q + j of a prepared 16-byte group is K-order byte 4j + q; the order is a permutation (same bytes)."""
    blocks = torch.arange(2 * 3 * 32, dtype=torch.int32).to(torch.uint8).reshape(2, 3, 32)
    prepared = probe.prepare_bytes(blocks)
    assert prepared.shape == blocks.shape and torch.equal(prepared.sort(dim=-1).values, blocks.sort(dim=-1).values)
    for q in range(4):
        assert prepared[1, 2, 16 + 4 * q: 16 + 4 * q + 4].tolist() == blocks[1, 2, 16 + q: 32: 4].tolist()


@needs_gpu
def test_bf16x2_decode_gives_every_bytes_values():
    assert "equal to the reference" in probe.check_decode_table(torch.device(DEVICE))
