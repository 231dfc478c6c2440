"""The two ceilings every benchmark cell is judged against, measured in the same run.

- R, the read-only bandwidth: a Triton grid-stride reduction over a buffer of several GB that keeps many 16-byte
  loads in flight per SM; a few launch shapes are tried and the best is kept (torch.sum is reported beside it: it
  reads slower than what a well-pipelined kernel reaches, so it would make the floor too easy).
- the device-to-device copy bandwidth (bytes read + bytes written), for reference.
- P, the dense bf16 matmul rate: torch.matmul on random 8192^3 operands (never zeros: they run faster).

All timing goes through a `timer` with `plain(fn) -> ms` so the CPU smoke test can stand in a counting stub.
"""

import triton
import triton.language as tl
import torch

# (BLOCK, UNROLL, num_warps, programs per SM): BLOCK*UNROLL fp32 per program and iteration; each thread issues
# BLOCK*UNROLL/(32*num_warps*4) independent 16-byte loads before it adds any of them.
READ_CONFIGS = (
    (2048, 4, 8, 2),
    (4096, 2, 8, 4),
    (2048, 2, 4, 8),
    (4096, 4, 8, 2),
    (1024, 8, 4, 4),
)


@triton.jit
def _stream_read_kernel(x_ptr, partial_ptr, n_elements, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Grid: (n_programs,). Program p sums the chunks p, p + n_programs, ... of BLOCK*UNROLL elements.

    n_elements must be a multiple of BLOCK*UNROLL (the buffer is sized so), so no load needs a mask.
    """
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(pid, n_elements // (BLOCK * UNROLL), tl.num_programs(0)):
        start = c * (BLOCK * UNROLL)  # a constant multiple: the compiler knows the loads are 16-byte aligned
        for u in tl.static_range(UNROLL):
            acc += tl.load(x_ptr + start + u * BLOCK + offs)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def _num_sms(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def measure_read_bandwidth(timer, device, nbytes):
    """Best Triton streaming-read bandwidth (bytes/s) over READ_CONFIGS, plus every config's figure."""
    chunk = max(block * unroll for block, unroll, _, _ in READ_CONFIGS)
    n = max(chunk, (nbytes // 4) // chunk * chunk)
    x = torch.randn(n, device=device, dtype=torch.float32)
    sms = _num_sms(device)
    expect = x.double().sum().item()
    tried = []
    for block, unroll, num_warps, per_sm in READ_CONFIGS:
        n_programs = min(sms * per_sm, n // (block * unroll))
        partial = torch.empty(n_programs, device=device, dtype=torch.float32)

        def run(block=block, unroll=unroll, num_warps=num_warps, n_programs=n_programs, partial=partial):
            _stream_read_kernel[(n_programs,)](x, partial, n, BLOCK=block, UNROLL=unroll, num_warps=num_warps)

        run()
        # the kernel's sum must equal torch's (it read every element exactly once)
        got = partial.double().sum().item()
        if abs(got - expect) > 1e-3 * (abs(expect) + x.numel() ** 0.5):
            raise RuntimeError(f"stream-read kernel summed {got}, torch {expect} (config {block, unroll})")
        ms = timer.plain(run)
        tried.append({"block": block, "unroll": unroll, "num_warps": num_warps, "programs": n_programs,
                      "ms": ms, "bytes_per_s": x.numel() * 4 / (ms * 1e-3)})
    sum_ms = timer.plain(lambda: x.sum())
    best = max(tried, key=lambda t: t["bytes_per_s"])
    return {
        "read_bytes_per_s": best["bytes_per_s"],
        "read_best_config": best,
        "read_configs": tried,
        "torch_sum_bytes_per_s": x.numel() * 4 / (sum_ms * 1e-3),
        "read_buffer_bytes": x.numel() * 4,
    }


def measure_copy_bandwidth(timer, device, nbytes):
    """Device-to-device copy bandwidth, bytes read + bytes written per second."""
    src = torch.randn(max(1, nbytes // 4), device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = timer.plain(lambda: dst.copy_(src))
    return {"copy_bytes_per_s": 2 * src.numel() * 4 / (ms * 1e-3), "copy_buffer_bytes": src.numel() * 4}


def measure_matmul_rate(timer, device, size, dtype=torch.bfloat16):
    """torch.matmul FLOP/s on random [size, size] x [size, size] operands."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = timer.plain(lambda: torch.matmul(a, b))
    return {"matmul_flops_per_s": 2 * size**3 / (ms * 1e-3), "matmul_size": size, "matmul_dtype": str(dtype)}


def measure_ceilings(timer, device, *, nbytes, matmul_size):
    out = {}
    out.update(measure_read_bandwidth(timer, device, nbytes))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out.update(measure_copy_bandwidth(timer, device, nbytes // 2))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out.update(measure_matmul_rate(timer, device, matmul_size))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
