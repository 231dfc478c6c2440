"""Reference figures the forward benchmark is compared against (issue 12), in microseconds, keyed by (model, T).

VLLM_US: vLLM's `fused_moe_kernel` (its two GEMM launches only: token alignment, activation and the sum of the k rows
excluded), the best of vLLM's tuned H200 table and a sweep of 5-9 standard configs, bf16, balanced random softmax
routing, each call timed as CUDA-graph replays of the call repeated in one graph with no L2 flush, median; measured
on one H200 (torch 2.11, triton 3.6) by issue 12's author. vLLM is not in the GPU image this project runs on, so the
figures cannot be re-measured beside ours in one run: they are compared with our `hot_us` (the same method).

BEFORE_US: this package's `fused_experts` measured the same way in the same run as VLLM_US (the issue's "yours"):
the "no cell slower than today" line.
"""

TOKENS = (1, 4, 16, 128, 1024, 4096, 16384)

_ROWS = {  # model: ((ours before, vLLM) for each T in TOKENS)
    "mixtral-8x7b": ((177, 179), (418, 409), (645, 647), (846, 665), (1409, 1308), (4368, 4650), (18879, 19859)),
    "mixtral-8x22b": ((282, 286), (690, 699), (1097, 1090), (1384, 1120), (2304, 2202), (8573, 8151),
                      (32714, 31666)),
    "qwen2-57b-a14b": ((118, 109), (338, 331), (732, 723), (924, 820), (1365, 1124), (3130, 2845), (12863, 12000)),
    "qwen3-30b-a3b": ((34.9, 25.6), (83.7, 69.9), (209, 189), (310, 291), (389, 350), (739, 648), (2376, 2210)),
    "deepseek-v3": ((179, 170), (619, 605), (1889, 1873), (4940, 4884), (6197, 5626), (8219, 9814), (23138, 25332)),
    "gpt-oss-120b": ((68.7, 55.8), (207, 194), (585, 584), (1429, 1423), (1763, 1572), (2106, 2158), (6058, 6039)),
}

BEFORE_US = {(model, t): pair[0] for model, pairs in _ROWS.items() for t, pair in zip(TOKENS, pairs)}
VLLM_US = {(model, t): pair[1] for model, pairs in _ROWS.items() for t, pair in zip(TOKENS, pairs)}
