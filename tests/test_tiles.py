"""Tile tables: every shipped table parses and holds runtime data only, the tiles selected from it fit its device's
shared memory in every dtype, and device names find their table."""

import json
import os

import pytest
import torch

from moe_dispatch import decode, tiles

CONFIG_DIR = os.path.join(os.path.dirname(tiles.__file__), "configs")
# Shared memory per block each table's device offers (bytes): SM90 227 KB, SM80 163 KB, gfx942 LDS 64 KB.
SMEM_LIMIT = {"NVIDIA_H200": 227 * 1024, "NVIDIA_A100": 163 * 1024, "AMD_Instinct_MI300X": 64 * 1024,
              "default": 64 * 1024, "interpreter": None}
TABLES = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))
RUNTIME_KEYS = {"device", "measured", "note", "buckets", "shapes", "decode", "fp8"}  # a tuning run's log goes to docs/results/
# The w8a8 FP8 path runs on NVIDIA SM89+ only: shared memory per block of the devices each table with "fp8" serves
# (default.json: H100 227 KB, L40S / SM89 99 KB).
FP8_SMEM_LIMIT = {"NVIDIA_H200": 227 * 1024, "default": 99 * 1024, "interpreter": None}
BUCKET_KEYS = {"max_rows_per_expert", "block_m", "gate_up", "down"}
DECODE_BUCKET_KEYS = {"max_assignments", "gate_up", "down"}


def _buckets(table):
    """(E, F, H) or None for the generic list, and that list's buckets."""
    yield None, table["buckets"]
    for shape, buckets in table.get("shapes", {}).items():
        yield tuple(int(n) for n in shape.split(",")), buckets


@pytest.mark.parametrize("name", TABLES)
def test_table_parses_and_holds_runtime_data_only(name):
    table = json.load(open(os.path.join(CONFIG_DIR, f"{name}.json")))
    assert table["device"] == name and isinstance(table["measured"], bool)
    assert set(table) <= RUNTIME_KEYS, set(table) - RUNTIME_KEYS
    for _, buckets in _buckets(table):
        thresholds = [b["max_rows_per_expert"] for b in buckets]
        assert thresholds == sorted(thresholds)
        for bucket in buckets:
            assert set(bucket) == BUCKET_KEYS, (name, bucket)
            tiles.MoeTiles.from_dict(bucket)


@pytest.mark.parametrize("name", [n for n in TABLES if "fp8" in tiles.load_table(n)])
def test_fp8_tiles_are_valid_and_fit_shared_memory(name, monkeypatch):
    """The "fp8" buckets parse, already meet the w8a8 constraints (BLOCK_K a power of two >= 32, GEMM1's BLOCK_N a
    multiple of GEMM2's group: `w8a8_tiles` changes nothing), and fit shared memory: GEMM1 holds an A tile (bf16 when
    x is quantized in its loads, below BLOCK_M 64; e4m3 from the quantization pass above) and two e4m3 weight tiles
    per stage, GEMM2 an e4m3 A tile and one weight tile."""
    from moe_dispatch.fp8 import WeightScale
    from moe_dispatch.fp8_gemm import w8a8_tiles
    from moe_dispatch.planner import PREQUANTIZE_MIN_BLOCK_M

    monkeypatch.setattr(tiles, "device_key", lambda device: name)
    table = tiles.load_table(name)
    assert set(table["fp8"]) <= {"note", "buckets", "shapes", "decode"}
    channel = WeightScale.of(torch.ones(8, 256), "channel", (128, 128), transposed=False)
    limit = FP8_SMEM_LIMIT[name]
    for bucket in table["fp8"]["buckets"]:
        assert set(bucket) == BUCKET_KEYS, bucket
        rows = bucket["max_rows_per_expert"]
        chosen = tiles.select_fp8_tiles(torch.device("cpu"), min(rows, 1 << 20) * 8, 1, 8, 256, 512)
        assert chosen == tiles.MoeTiles.from_dict(bucket)
        assert w8a8_tiles(chosen, channel, channel) == chosen, bucket
        a_bytes = 1 if chosen.block_m >= PREQUANTIZE_MIN_BLOCK_M else 2
        gate_up, down = chosen.gate_up, chosen.down
        smem1 = gate_up.num_stages * (chosen.block_m * a_bytes + 2 * gate_up.block_n) * gate_up.block_k
        smem2 = down.num_stages * (chosen.block_m + down.block_n) * down.block_k
        assert limit is None or max(smem1, smem2) <= limit, (name, bucket, smem1, smem2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", TABLES)
def test_selected_tiles_fit_shared_memory(name, dtype, monkeypatch):
    """What select_tiles returns for every bucket of the table, in every dtype, fits the device's shared memory:
    num_stages copies of the A tile and the weight tiles (two for gate_up: gate and up) in the dtype's bytes."""
    monkeypatch.setattr(tiles, "device_key", lambda device: name)
    table = tiles.load_table(name)
    limit = SMEM_LIMIT[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    for shape, buckets in _buckets(table):
        E, F, H = shape or (8, 256, 512)
        for bucket in buckets:
            rows = bucket["max_rows_per_expert"]  # top_k = 1 and T = rows * E: exactly this many rows per expert
            chosen = tiles.select_tiles(torch.device("cpu"), rows * E, 1, E, F, H, dtype)
            assert chosen.block_m == bucket["block_m"]
            for factor, gemm in ((2, chosen.gate_up), (1, chosen.down)):
                smem = gemm.num_stages * (chosen.block_m + factor * gemm.block_n) * gemm.block_k * itemsize
                assert limit is None or smem <= limit, (name, dtype, bucket, smem)


def _decode_buckets(table, *, fp8=False):
    """(E, F, H) or None for the generic list, and that list's decode buckets, of the float-weight `decode` entry or
    (`fp8`) of the "fp8" section's (none without a decode entry)."""
    decode_entry = table.get("fp8", {}).get("decode") if fp8 else table.get("decode")
    if decode_entry is None:
        return
    yield None, decode_entry["buckets"]
    for shape, buckets in decode_entry.get("shapes", {}).items():
        yield tuple(int(n) for n in shape.split(",")), buckets


@pytest.mark.parametrize("name", TABLES)
def test_decode_entries_parse_and_stay_in_the_kernel_limit(name):
    table = tiles.load_table(name)
    assert set(table.get("decode", {})) <= {"buckets", "shapes"}
    assert set(table.get("fp8", {}).get("decode", {})) <= {"buckets", "shapes"}
    for _, buckets in [*_decode_buckets(table), *_decode_buckets(table, fp8=True)]:
        limits = [b["max_assignments"] for b in buckets]
        assert limits == sorted(limits) and all(0 < n <= tiles.MAX_DECODE_ASSIGNMENTS for n in limits), (name, limits)
        for bucket in buckets:
            assert set(bucket) == DECODE_BUCKET_KEYS, (name, bucket)
            tiles.DecodeTiles.from_dict(bucket)


@pytest.mark.parametrize("fp8", [False, True], ids=["float-weights", "fp8-weights"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", TABLES)
def test_selected_decode_tiles_fit_shared_memory(name, dtype, fp8, monkeypatch):
    """At each bucket's largest N with top_k = 1 (the most x rows, BLOCK_T = N): the stages decode.py launches
    (`pipeline_stages` of the table's, for the device's shared memory) of the x tile and the gate and up tiles
    (gate/up kernel), of the weight tile (down kernel, pipelined loads), x in the dtype's bytes, weights in the dtype's
    or (float8) one byte, fit; and they are the table's own wherever those fit."""
    monkeypatch.setattr(tiles, "device_key", lambda device: name)
    limit = SMEM_LIMIT[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    w_itemsize = 1 if fp8 else itemsize
    for shape, buckets in _decode_buckets(tiles.load_table(name), fp8=fp8):
        E, F, H = shape or (8, 256, 512)
        for bucket in buckets:
            num_tokens = bucket["max_assignments"]
            chosen = tiles.select_decode_tiles(torch.device("cpu"), num_tokens, 1, E, F, H, dtype, fp8=fp8)
            block_t = max(16, 1 << (num_tokens - 1).bit_length())
            gate_up, down = chosen.gate_up, chosen.down
            for tile, stage in ((gate_up, (block_t * itemsize + 2 * gate_up.block_n * w_itemsize) * gate_up.block_k),
                                (down, down.block_n * down.block_k * w_itemsize)):
                stages = decode.pipeline_stages(tile.num_stages, stage, limit)
                assert limit is None or stages * stage <= limit, (name, dtype, bucket, stages * stage)
                assert stages == tile.num_stages or tile.num_stages * stage > limit, (name, bucket)


@pytest.mark.parametrize("key,expected", [("NVIDIA_H200", "NVIDIA_H200"), ("NVIDIA_A100_SXM4_80GB", "NVIDIA_A100"),
                                          ("AMD_Instinct_MI300X", "AMD_Instinct_MI300X"),
                                          ("NVIDIA_H200_NVL", "NVIDIA_H200"), ("Some_New_GPU", "default")])
def test_device_names_find_their_table(key, expected):
    assert os.path.basename(tiles.table_path(key)) == f"{expected}.json"


def test_host_integer_helpers_match_triton():
    """The launchers' plain cdiv / next_power_of_2 give Triton's values (they replace its constexpr functions on the
    host, which cost microseconds per call)."""
    import triton

    from moe_dispatch._host_math import cdiv, next_power_of_2

    for n in range(0, 4100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert next_power_of_2(2**31 + 1) == 2**32 == triton.next_power_of_2(2**31 + 1)
