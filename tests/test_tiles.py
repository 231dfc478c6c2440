"""Tile tables: every shipped table parses and holds runtime data only (provenance at its top level), names its GEMM
kernels (`persistent`) as a table of the integer form selects alike, the tiles selected from it fit its device's
shared memory in every dtype, and device names find their table."""

import dataclasses
import json
import os

import pytest
import torch

from moe_dispatch.gemm import decode
from moe_dispatch.host import tiles

CONFIG_DIR = tiles._CONFIG_DIR
# Shared memory per block each table's device offers (bytes): SM90 227 KB, SM80 163 KB, gfx942 LDS 64 KB.
SMEM_LIMIT = {"NVIDIA_H200": 227 * 1024, "NVIDIA_A100": 163 * 1024, "AMD_Instinct_MI300X": 64 * 1024,
              "default": 64 * 1024, "interpreter": None}
TABLES = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))
# a tuning run's log goes to docs/results/
RUNTIME_KEYS = {"device", "measured", "note", "fp8_note", "mxfp4_note", "buckets", "shapes", "decode", "fp8", "mxfp4"}
PROVENANCE_KEYS = {"measured", "note", "fp8_note", "mxfp4_note"}  # top level only: no selection reads them
# The w8a8 FP8 path runs on NVIDIA SM89+ only: shared memory per block of the devices each table with "fp8" serves
# (default.json: H100 227 KB, L40S / SM89 99 KB).
FP8_SMEM_LIMIT = {"NVIDIA_H200": 227 * 1024, "default": 99 * 1024, "interpreter": None}
BUCKET_KEYS = {"max_rows_per_expert", "block_m", "gate_up", "down"}
DECODE_BUCKET_KEYS = {"max_assignments", "gate_up", "down"}


def _buckets(table):
    """(E, F, H) or None for the generic list, and that list's buckets (an mxfp4 section may have no generic list)."""
    yield None, table.get("buckets", [])
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
    mxfp4 = table.get("mxfp4", {})
    assert set(mxfp4) <= {"buckets", "shapes", "decode"}, (name, set(mxfp4))
    for _, buckets in _buckets(mxfp4):
        assert [b["max_rows_per_expert"] for b in buckets] == sorted(b["max_rows_per_expert"] for b in buckets)
        for bucket in buckets:
            assert set(bucket) == BUCKET_KEYS, (name, "mxfp4", bucket)
            tiles.MoeTiles.from_dict(bucket)
    for _, buckets in _buckets(mxfp4.get("decode", {})):
        assert [b["max_assignments"] for b in buckets] == sorted(b["max_assignments"] for b in buckets)
        assert all(set(b) == DECODE_BUCKET_KEYS for b in buckets), (name, "mxfp4 decode", buckets)


def _gemm_entries(table, sections=("bf16", "fp8")):
    """(section, GEMM, entry) of every GEMM entry of a table's bf16 and fp8 (and mxfp4, when asked) buckets, generic
    and per shape."""
    parts = {"bf16": table, "fp8": table.get("fp8"), "mxfp4": table.get("mxfp4")}
    for section, part in ((section, parts[section]) for section in sections):
        if part is not None:
            for _, buckets in _buckets(part):
                for bucket in buckets:
                    for gemm in ("gate_up", "down"):
                        yield section, gemm, bucket[gemm]


def _with_integer_kernels(table):
    """A copy of `table` in the form tables had before the names: each `persistent` as its member's integer."""
    old = json.loads(json.dumps(table))
    for _, _, entry in _gemm_entries(old):
        if "persistent" in entry:
            entry["persistent"] = int(tiles.Persistent.parse(entry["persistent"]))
    return old


@pytest.mark.parametrize("name", TABLES)
def test_provenance_stays_at_the_top_and_kernels_are_named(name):
    """Below the top level a table holds only what selection reads; each GEMM's `persistent` is a member's name."""
    table = json.load(open(os.path.join(CONFIG_DIR, f"{name}.json")))

    def below_top(node, path):
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in children:
            assert not (path and key in PROVENANCE_KEYS), (name, path, key)
            below_top(child, path + [key])

    below_top(table, [])
    names = {member.name.lower() for member in tiles.Persistent}
    for section, gemm, entry in _gemm_entries(table, ("bf16", "fp8", "mxfp4")):
        assert entry.get("persistent", "off") in names, (name, section, gemm, entry)


# The H200 table's explicit kernel choices per (section, GEMM, member) when the integers became names: a conversion
# that lost or changed one changes a count (the fp8 "off" counts are those of the retune for swapped small tiles; the
# fp8 "on" counts, the BLOCK_M 128 buckets moved to the persistent kernel with paired gate/up dots, plus one tuned).
H200_KERNELS = {("bf16", "gate_up", "on"): 13, ("bf16", "gate_up", "off"): 4, ("bf16", "down", "on"): 8,
                ("bf16", "down", "off"): 7, ("fp8", "gate_up", "on"): 8, ("fp8", "gate_up", "off"): 12,
                ("fp8", "down", "on"): 8, ("fp8", "down", "off"): 12}


def test_h200_kernel_choices_kept_their_values():
    counts = {}
    for section, gemm, entry in _gemm_entries(tiles.load_table("NVIDIA_H200")):
        if "persistent" in entry:
            key = (section, gemm, entry["persistent"])
            counts[key] = counts.get(key, 0) + 1
    assert counts == H200_KERNELS


@pytest.mark.parametrize("name", TABLES)
def test_a_table_with_integer_kernels_selects_the_same_tiles(name, monkeypatch):
    """Tuned tables written before the names (`persistent` 0 / 1 / 2) still load: every bucket, bf16 and fp8, selects
    tiles equal to the named table's, each `persistent` a Persistent member either way."""
    named = tiles.load_table(name)
    old = _with_integer_kernels(named)
    monkeypatch.setattr(tiles, "device_key", lambda device: name)
    for section, select in (("bf16", tiles.select_tiles), ("fp8", tiles.select_fp8_tiles)):
        part = named if section == "bf16" else named.get("fp8", named)
        for shape, buckets in _buckets(part):
            E, F, H = shape or (8, 256, 512)
            for bucket in buckets:
                T = min(bucket["max_rows_per_expert"], 1 << 20) * E
                chosen = []
                for table in (named, old):
                    monkeypatch.setattr(tiles, "load_table", lambda key, table=table: table)
                    chosen.append(select(torch.device("cpu"), T, 1, E, F, H))
                assert chosen[0] == chosen[1], (name, section, shape, bucket)
                for tile in chosen:
                    assert type(tile.gate_up.persistent) is tiles.Persistent, (name, section, shape, bucket)
                    assert type(tile.down.persistent) is tiles.Persistent, (name, section, shape, bucket)


@pytest.mark.parametrize("value,expected", [("on", tiles.Persistent.ON), ("Off", tiles.Persistent.OFF),
                                            ("ON", tiles.Persistent.ON), (0, tiles.Persistent.OFF),
                                            (1, tiles.Persistent.ON)])
def test_persistent_reads_names_and_integers(value, expected):
    assert tiles.Persistent.parse(value) is expected
    tile = tiles.GemmTile.from_dict({"block_n": 64, "block_k": 32, "persistent": value})
    assert tile.persistent is expected


@pytest.mark.parametrize("value", ["gather_first", "GATHER_FIRST", 2])
def test_v1_gather_first_reads_as_on_with_a_warning(value):
    """1.0's "gather_first" (2), removed in 1.1 (it measured within noise of "on"): v1 tables and forced tiles keep
    loading, as the persistent kernel, and say so."""
    with pytest.warns(DeprecationWarning, match="gather_first"):
        tile = tiles.GemmTile.from_dict({"block_n": 64, "block_k": 32, "persistent": value})
    assert tile.persistent is tiles.Persistent.ON


@pytest.mark.parametrize("value", ["persistent", "gather first", 3, -1, True, None, 1.0])
def test_persistent_refuses_other_values(value):
    """A misspelt or out-of-range kernel in a hand-edited table fails at load, naming what is accepted."""
    with pytest.raises(ValueError, match=r"one of 'off', 'on' \(or 0-1\)"):
        tiles.MoeTiles.from_dict({"block_m": 16, "gate_up": {"block_n": 64, "block_k": 32, "persistent": value},
                                  "down": {"block_n": 64, "block_k": 32}})


def test_tiles_write_the_named_form_and_read_it_back():
    """What a tuner writes (`to_dict`, through json) names the kernel and loads back as the same tiles."""
    chosen = tiles.MoeTiles(64, tiles.GemmTile(128, 64, 8, 4, 8, tiles.Persistent.OFF),
                            tiles.GemmTile(256, 64, 8, 3, 8, 1))
    written = json.loads(json.dumps(chosen.to_dict()))
    assert (written["gate_up"]["persistent"], written["down"]["persistent"]) == ("off", "on")
    assert tiles.MoeTiles.from_dict(written) == chosen


@pytest.mark.parametrize("name", [n for n in TABLES if "fp8" in tiles.load_table(n)])
def test_fp8_tiles_are_valid_and_fit_shared_memory(name, monkeypatch):
    """The "fp8" buckets parse, already meet the w8a8 constraints (BLOCK_K a power of two >= 32, GEMM1's BLOCK_N a
    multiple of GEMM2's group: `w8a8_tiles` changes nothing), and fit shared memory: GEMM1 holds an A tile (bf16 when
    x is quantized in its loads, below BLOCK_M 64; e4m3 from the quantization pass above) and two e4m3 weight tiles
    per stage, GEMM2 an e4m3 A tile and one weight tile."""
    from moe_dispatch.formats.fp8 import WeightScale
    from moe_dispatch.gemm.w8a8 import w8a8_tiles
    from moe_dispatch.gemm.planner import PREQUANTIZE_MIN_BLOCK_M

    monkeypatch.setattr(tiles, "device_key", lambda device: name)
    table = tiles.load_table(name)
    assert set(table["fp8"]) <= {"buckets", "shapes", "decode"}
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
    for fp8 in (False, True):
        for _, buckets in _decode_buckets(table, fp8=fp8):
            limits = [b["max_assignments"] for b in buckets]
            assert limits == sorted(limits) and all(0 < n <= tiles.MAX_DECODE_ASSIGNMENTS for n in limits), (name, limits)
            for bucket in buckets:
                # FP8 buckets may send fp8_compute="auto" to w8a8 (their tiles then serve "dequant" alone)
                optional = {"auto"} if fp8 else set()
                assert DECODE_BUCKET_KEYS <= set(bucket) <= DECODE_BUCKET_KEYS | optional, (name, bucket)
                assert bucket.get("auto", tiles.AUTO_W8A8) == tiles.AUTO_W8A8, (name, bucket)
                tiles.DecodeTiles.from_dict(bucket)


@pytest.mark.parametrize("fp8", [False, True], ids=["float-weights", "fp8-weights"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", TABLES)
def test_selected_decode_tiles_fit_shared_memory(name, dtype, fp8, monkeypatch):
    """At each bucket's largest N with top_k = 1 (the most x rows, BLOCK_T = N): the stages gemm/decode.py launches
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
                                          ("NVIDIA_H200_NVL", "NVIDIA_H200"), ("NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"),
                                          ("NVIDIA_H100", "NVIDIA_H200"), ("Some_New_GPU", "default")])
def test_device_names_find_their_table(key, expected):
    assert os.path.basename(tiles.table_path(key)) == f"{expected}.json"


def test_host_integer_helpers_match_triton():
    """The launchers' plain cdiv / next_power_of_2 give Triton's values (they replace its constexpr functions on the
    host, which cost microseconds per call)."""
    import triton

    from moe_dispatch.host.host_math import cdiv, next_power_of_2

    for n in range(0, 4100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert next_power_of_2(2**31 + 1) == 2**32 == triton.next_power_of_2(2**31 + 1)


@pytest.mark.parametrize("num_tokens,limit_tile", [(1, 0), (4, 1)], ids=["4-assignments", "16-assignments"])
def test_transposed_down_weights_take_the_dot_decode_tile(num_tokens, limit_tile):
    """Transposed down weights ([E, F, H]) take TRANSPOSED_DOWN_DECODE_TILES' dot tile for their decode down GEMM,
    float weights only; the gate/up tile and the [E, H, F] layout's tiles stay the table's."""
    device = torch.device("cpu")
    args = (device, num_tokens, 4, 8, 64, 32)
    table = tiles.select_decode_tiles(*args)
    assert table is not None
    chosen = tiles.select_decode_tiles(*args, transposed=True)
    assert chosen.down == tiles.TRANSPOSED_DOWN_DECODE_TILES[limit_tile][1] and chosen.down.dot
    assert chosen.gate_up == table.gate_up
    assert tiles.select_decode_tiles(*args, fp8=True, transposed=True) == tiles.select_decode_tiles(*args, fp8=True)
    from moe_dispatch.gemm.planner import ExpertsPath, plan_experts
    plan = plan_experts(device, num_tokens, 4, 8, 64, 32, torch.bfloat16, transposed=True)
    assert plan.path is ExpertsPath.DECODE and plan.tiles == chosen


def test_register_caps_load_from_tables_and_travel_as_ints():
    """A GEMM entry's `maxnreg` loads into its tile, survives the flat int form the custom operators take, and
    leaves the table form when unset; an uncapped tile adds no launch option."""
    entry = {"block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 3, "group_m": 8, "maxnreg": 64}
    capped = tiles.GemmTile.from_dict(entry)
    assert capped.maxnreg == 64
    assert capped.to_dict() == {**entry, "persistent": "off"}
    plain = tiles.GemmTile.from_dict({k: v for k, v in entry.items() if k != "maxnreg"})
    assert plain.maxnreg == 0 and "maxnreg" not in plain.to_dict()
    both = tiles.MoeTiles(64, capped, plain)
    assert tiles.MoeTiles.from_list(both.to_list()) == both
    from moe_dispatch.gemm.args import register_cap
    assert register_cap(plain) == {}


def test_register_caps_reach_nvidia_compiles_only(monkeypatch):
    """`register_cap` gives Triton's `maxnreg` for an NVIDIA GPU and nothing for AMD or the interpreter (the option
    is NVIDIA's)."""
    from moe_dispatch.gemm import args

    capped = tiles.GemmTile(64, 64, 8, 3, 8, maxnreg=64)
    for cuda, interpreted, expected in ((True, False, {"maxnreg": 64}), (False, False, {}), (True, True, {})):
        monkeypatch.setattr(args, "is_cuda", lambda cuda=cuda: cuda)
        monkeypatch.setattr(args, "is_interpreter", lambda interpreted=interpreted: interpreted)
        assert args.register_cap(capped) == expected, (cuda, interpreted)
        assert args.register_cap(dataclasses.replace(capped, maxnreg=0)) == {}
