"""Tile tables: every shipped table parses, fits its device's shared memory, and device names find their table."""

import json
import os

import pytest
import torch

from moe_dispatch import tiles

CONFIG_DIR = os.path.join(os.path.dirname(tiles.__file__), "configs")
# Shared memory per block each table's device offers (bytes): SM90 227 KB, SM80 163 KB, gfx942 LDS 64 KB.
SMEM_LIMIT = {"NVIDIA_H200": 227 * 1024, "NVIDIA_A100": 163 * 1024, "AMD_Instinct_MI300X": 64 * 1024,
              "default": 64 * 1024, "interpreter": None}
TABLES = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def _entries(table):
    yield from table["buckets"]
    for buckets in table.get("shapes", {}).values():
        yield from buckets


@pytest.mark.parametrize("name", TABLES)
def test_table_parses_and_fits(name):
    table = json.load(open(os.path.join(CONFIG_DIR, f"{name}.json")))
    assert table["device"] == name and isinstance(table["measured"], bool)
    limit = SMEM_LIMIT[name]
    for entry in _entries(table):
        moe_tiles = tiles.MoeTiles.from_dict(entry)
        for factor, gemm in ((2, moe_tiles.gate_up), (1, moe_tiles.down)):  # gate_up loads two weight tiles
            stage = (moe_tiles.block_m * gemm.block_k + factor * gemm.block_n * gemm.block_k) * 2  # bf16 bytes
            assert limit is None or gemm.num_stages * stage <= limit, (name, entry)
    thresholds = [b["max_rows_per_expert"] for b in table["buckets"]]
    assert thresholds == sorted(thresholds)


@pytest.mark.parametrize("key,expected", [("NVIDIA_H200", "NVIDIA_H200"), ("NVIDIA_A100_SXM4_80GB", "NVIDIA_A100"),
                                          ("AMD_Instinct_MI300X", "AMD_Instinct_MI300X"),
                                          ("NVIDIA_H200_NVL", "NVIDIA_H200"), ("Some_New_GPU", "default")])
def test_device_names_find_their_table(key, expected):
    assert os.path.basename(tiles.table_path(key)) == f"{expected}.json"


def test_fp32_halves_block_k():
    device = torch.device("cpu")
    bf16 = tiles.select_tiles(device, 64, 2, 8, 64, 64, torch.bfloat16)
    fp32 = tiles.select_tiles(device, 64, 2, 8, 64, 64, torch.float32)
    assert fp32.gate_up.block_k == max(16, bf16.gate_up.block_k // 2)
    assert fp32.down.block_k == max(16, bf16.down.block_k // 2)
