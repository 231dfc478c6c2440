"""Tile tables: which GEMM tiles each problem size gets, as data.

`configs/<device_key>.json` (see `host.device.device_key`) holds, per device, a list of buckets keyed by the expected
number of rows per expert (`T * top_k / E`), optionally overridden per model shape `"E,F,H"`::

    {"device": "NVIDIA_H200", "measured": true, "note": "how and where it was measured", "fp8_note": "...",
     "buckets": [{"max_rows_per_expert": 16, "block_m": 16,
                  "gate_up": {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "group_m": 1},
                  "down":    {..., "persistent": "on"}}, ...],
     "shapes": {"8,14336,4096": [<buckets>]}}

The first bucket whose `max_rows_per_expert` is >= the problem's value is used (the last one past the end). A GEMM's
optional `persistent` names a `Persistent` member in lower case ("off", the default; "on"); the integers 0 and 1 of
older tables load too. Its optional `maxnreg` caps the registers per thread (NVIDIA; 0 or absent: no cap), so that more
programs share an SM. Provenance ("measured", "note", "fp8_note") stays at the top level, which
no selection reads. The w8a8 FP8 path (gemm/w8a8.py) reads its own buckets,
`"fp8": {"buckets": [...], "shapes": {...}}`, in the same form (BLOCK_K there is the activation group;
`gemm.w8a8.w8a8_tiles` applies the path's constraints); a table without them lends the FP8 path its bf16 buckets with
BLOCK_K 128. A table also serves device names it prefixes (`NVIDIA_A100.json` for `NVIDIA_A100_SXM4_80GB`) and those
`TABLE_ALIASES` gives it (the H100 reads the H200's); unknown devices fall back to `configs/default.json` (logged
once). `scripts/tune` regenerates a table on a new device.

An optional `decode` entry turns on the two-launch decode path (gemm/decode.py) for small problems, keyed by the number
of assignments N = T * top_k, optionally per model shape::

    "decode": {"buckets": [{"max_assignments": 64,
                            "gate_up": {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3},
                            "down":    {...}}],
               "shapes": {"8,14336,4096": [<buckets>]}}

The first bucket with N <= `max_assignments` is used; past the last one (or with an empty list, or in a table without
the entry) the general path runs. A decode tile's optional fields: `split_k` and `dot` (the down kernel's: splits along
F, one tensor-core dot per expert hit instead of a GEMV per assignment), `gemv` (the gate/up kernel's: a GEMV per
assignment instead of a dot per expert hit), `mma` (either kernel's, MXFP4 weights: gemm/gluon_mxfp4_decode.py's
mma.sync kernel); see `DecodeTile`. float8 weights read `"fp8": {"decode": {...}}`, in the
same form; a bucket there may say `"auto": "w8a8"`: `fp8_compute="auto"` then runs the w8a8 path instead of the decode
path (measured faster there), and the bucket's tiles serve `fp8_compute="dequant"` (`fp8_auto_takes_w8a8`).
`scripts/tune --path decode` measures the entries.

MXFP4 weights read an optional `"mxfp4"` section: `{"buckets": [...], "shapes": {...}, "decode": {...}}`, each part in
the forms above (the grouped path's buckets, the decode entry); a part it lacks falls
back to the float weights' buckets and to the "fp8" decode entry (`select_tiles`, `select_decode_tiles`).
`scripts/tune --mxfp4` measures it.
"""

import dataclasses
import enum
import functools
import json
import logging
import os
import warnings

import torch

from .device import device_key, has_tma, has_wgmma, is_hip, on_gpu, smem_per_program

_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")  # the package's configs/
_log = logging.getLogger(__name__)


# The decode path's bound: the largest N = T * top_k its gate/up kernel's [BLOCK_A] id comparison is sized for.
MAX_DECODE_ASSIGNMENTS = 256

# What the kernels take of a forced tile (`check_forced_tiles`): block sides are `tl.arange` lengths (powers of two)
# and `tl.dot` operand sides (at least 16); a CTA has at most 32 warps (1024 threads), a power of two of them.
MIN_BLOCK = 16
MAX_WARPS = 32


class Persistent(enum.IntEnum):
    """`GemmTile.persistent`: which GEMM kernel a tile asks for, where the device and the operands allow it
    (gemm/planner.py decides). Tables name the member in lower case (`parse`)."""

    OFF = 0  # the pointer kernel (one program per output tile)
    ON = 1  # the persistent kernel fed by tensor descriptors (gemm/persistent.py; gemm/w8a8_persistent.py on w8a8)
    GATHER_FIRST = 1  # 1.0's third kernel (rows copied into expert order first), an alias of ON since 1.1 (`parse`)

    @classmethod
    def parse(cls, value) -> "Persistent":
        """A table's `persistent`: a member's name in any case ("on"), or its integer (tables written before the
        names); 1.0's "gather_first" (2) reads as ON with a DeprecationWarning. Anything else raises ValueError naming
        the accepted values."""
        if (isinstance(value, str) and value.lower() == "gather_first") or (type(value) is int and value == 2):
            # 1.0's "gather_first" (2): a copy of the rows into expert order before the persistent kernel, removed in
            # 1.1 as it measured within noise of "on"; v1 tables and forced tiles keep loading, as "on"
            warnings.warn("a tile's persistent 'gather_first' (2) runs as 'on' since moe-dispatch 1.1.0 (the copy "
                          "into expert order measured no faster); write 'on'", DeprecationWarning, stacklevel=3)
            return cls.ON
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        if isinstance(value, int) and not isinstance(value, bool) and value in cls._value2member_map_:
            return cls(value)
        names = ", ".join(repr(member.name.lower()) for member in cls)
        raise ValueError(f"a tile's persistent must be one of {names} (or 0-{len(cls) - 1}), got {value!r}")


@functools.lru_cache(maxsize=None)
def field_names(cls) -> tuple:
    """A tile dataclass's field names in order (looked up once per class)."""
    return tuple(field.name for field in dataclasses.fields(cls))


def field_values(tile) -> list:
    """A flat tile dataclass's field values in order: what `dataclasses.astuple` gives, without its deep copy of each
    value (every forward flattens its tiles for the custom operator; astuple cost ~10 us of host time per call)."""
    return [getattr(tile, name) for name in field_names(type(tile))]


@dataclasses.dataclass(frozen=True)
class GemmTile:
    """Launch parameters of one grouped GEMM (the M tile is shared: it is fixed by the dispatch tile map)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # M tiles walked together per N column, for L2 reuse of the weight tiles
    # Persistent.ON: the persistent kernel fed by tensor descriptors (gemm/persistent.py; gemm/w8a8_persistent.py on the
    # w8a8 path, from block_m 64) where the device and layout allow it. A plain int after `from_list` (equal to its
    # member)
    persistent: Persistent = Persistent.OFF
    # The most registers a thread of the GEMM kernel may hold (Triton's `maxnreg`; NVIDIA only, ignored elsewhere),
    # so that more programs fit an SM; 0: the compiler's choice
    maxnreg: int = 0

    @classmethod
    def from_dict(cls, entry):
        """A GEMM's tile from its table entry (`persistent` through `Persistent.parse`)."""
        if "persistent" not in entry:
            return cls(**entry)
        return cls(**{**entry, "persistent": Persistent.parse(entry["persistent"])})

    def to_dict(self):
        """The table entry: the fields by name, `persistent` by its member's name, `maxnreg` only where set."""
        entry = {**dataclasses.asdict(self), "persistent": Persistent(self.persistent).name.lower()}
        if not self.maxnreg:
            del entry["maxnreg"]
        return entry


@dataclasses.dataclass(frozen=True)
class MoeTiles:
    """Tiles of one MoE forward: `block_m` rows per tile (one expert per tile), then each GEMM's N/K tiles."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile

    @classmethod
    def from_dict(cls, entry):
        return cls(
            block_m=int(entry["block_m"]),
            gate_up=GemmTile.from_dict(entry["gate_up"]),
            down=GemmTile.from_dict(entry["down"]),
        )

    def to_dict(self):
        """The table form of the tiles (a bucket without its `max_rows_per_expert`)."""
        return {"block_m": self.block_m, "gate_up": self.gate_up.to_dict(), "down": self.down.to_dict()}

    def to_list(self) -> list[int]:
        """Flat ints (block_m, then each GEMM's fields in order): the form custom operators take."""
        return [self.block_m, *field_values(self.gate_up), *field_values(self.down)]

    @classmethod
    def from_list(cls, values):
        n = len(field_names(GemmTile))
        return cls(int(values[0]), GemmTile(*values[1:1 + n]), GemmTile(*values[1 + n:1 + 2 * n]))


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    """Launch parameters of one decode kernel: BLOCK_N output columns per program, BLOCK_K of the reduction per step."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    # the down kernel only: programs per (assignment, H tile) along F, so that few experts with a long F still put
    # enough loads in flight (summed in a fixed order, see gemm/decode.py)
    split_k: int = 1
    # the down kernel only: one tensor-core dot per expert hit over the rows of all its tokens (gemm/decode.py's
    # `_decode_down_dot_kernel`) instead of a GEMV per assignment; what wins once several tokens share experts
    dot: bool = False
    # the gate/up kernel only: a GEMV per assignment (gemm/decode.py's `_decode_gate_up_kernel` in its GEMV form, the weights
    # multiplied in registers) instead of a tensor-core dot per expert hit over 16 padded rows
    gemv: bool = False
    # either kernel, MXFP4 weights under bf16 activations where the Gluon kernels run (else the fields above choose):
    # gemm/gluon_mxfp4_decode.py's kernels, each expert's weights decoded once for all the tokens that picked it and
    # multiplied on mma.sync; 16 weight rows a warp (num_warps of them), K steps of 128; block_n, block_k,
    # num_stages and split_k are not read
    mma: bool = False

    def __post_init__(self):
        for name in ("dot", "gemv", "mma"):  # from flat ints (`DecodeTiles.from_list`) too; bool("False") would be True
            value = getattr(self, name)
            if type(value) is not bool:
                if type(value) is not int or value not in (0, 1):
                    raise TypeError(f"DecodeTile.{name} must be a bool, got {type(value).__name__} {value!r}")
                object.__setattr__(self, name, bool(value))


# First element of `DecodeTiles.to_list()`: a block_m of 0 (the decode path has no row tiles) tells it from MoeTiles'.
DECODE_MARKER = 0


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    """Tiles of the two-launch decode path (gemm/decode.py): the gate/up kernel's and the down kernel's."""

    gate_up: DecodeTile
    down: DecodeTile

    @classmethod
    def from_dict(cls, entry):
        return cls(gate_up=DecodeTile(**entry["gate_up"]), down=DecodeTile(**entry["down"]))

    def to_dict(self):
        return dataclasses.asdict(self)

    def to_list(self) -> list[int]:
        """Flat ints (DECODE_MARKER, then each kernel's fields in order): the form custom operators take."""
        return [DECODE_MARKER, *map(int, field_values(self.gate_up)), *map(int, field_values(self.down))]

    @classmethod
    def from_list(cls, values):
        n = len(field_names(DecodeTile))
        return cls(DecodeTile(*values[1:1 + n]), DecodeTile(*values[1 + n:1 + 2 * n]))


def check_forced_tiles(name: str, tiles) -> "MoeTiles | DecodeTiles | None":
    """A caller's forced tiles (the `tiles` argument, named `name`): None, or a MoeTiles of GemmTiles or a DecodeTiles
    of DecodeTiles whose fields the kernels take: ints (not bools or floats), block sides powers of two >= MIN_BLOCK,
    num_warps a power of two <= MAX_WARPS, num_stages, group_m and split_k >= 1, `persistent` a `Persistent` (or its
    int), `dot`, `gemv` and `mma` bools. TypeError / ValueError naming the field (`tiles.gate_up.block_k`) before anything runs."""
    if tiles is None:
        return None
    if isinstance(tiles, MoeTiles):
        _check_tile_int(f"{name}.block_m", tiles.block_m, block=True)
        parts, kind = {"gate_up": tiles.gate_up, "down": tiles.down}, GemmTile
    elif isinstance(tiles, DecodeTiles):
        parts, kind = {"gate_up": tiles.gate_up, "down": tiles.down}, DecodeTile
    else:
        raise TypeError(f"{name} must be a MoeTiles, a DecodeTiles or None, got {type(tiles).__name__}")
    for part, tile in parts.items():
        where = f"{name}.{part}"
        if not isinstance(tile, kind):
            raise TypeError(f"{where} must be a {kind.__name__}, got {type(tile).__name__}")
        _check_tile_int(f"{where}.block_n", tile.block_n, block=True)
        _check_tile_int(f"{where}.block_k", tile.block_k, block=True)
        _check_tile_int(f"{where}.num_warps", tile.num_warps)
        if tile.num_warps & (tile.num_warps - 1) or tile.num_warps > MAX_WARPS:
            raise ValueError(f"{where}.num_warps must be a power of two <= {MAX_WARPS}, got {tile.num_warps}")
        _check_tile_int(f"{where}.num_stages", tile.num_stages)
        if kind is GemmTile:
            _check_tile_int(f"{where}.group_m", tile.group_m)
            persistent = tile.persistent
            if (not isinstance(persistent, int) or isinstance(persistent, bool)
                    or persistent not in Persistent._value2member_map_):
                names = ", ".join(f"Persistent.{member.name}" for member in Persistent)
                raise ValueError(f"{where}.persistent must be one of {names}, got {persistent!r}")
        else:
            _check_tile_int(f"{where}.split_k", tile.split_k)
            for field in ("dot", "gemv", "mma"):
                if type(getattr(tile, field)) is not bool:
                    raise TypeError(f"{where}.{field} must be a bool, got {type(getattr(tile, field)).__name__} "
                                    f"{getattr(tile, field)!r}")
    return tiles


def _check_tile_int(name, value, *, block=False):
    """An int field of a forced tile: >= 1, and a power of two >= MIN_BLOCK where it is a block side."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if block and (value < MIN_BLOCK or value & (value - 1)):
        raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK} (a Triton block side), got {value}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def tiles_from_list(values) -> "MoeTiles | DecodeTiles":
    """The tiles an operator received as flat ints (`MoeTiles.to_list` or `DecodeTiles.to_list`)."""
    return DecodeTiles.from_list(values) if values[0] == DECODE_MARKER else MoeTiles.from_list(values)


@dataclasses.dataclass(frozen=True)
class WeightGradTile:
    """Launch parameters of the per-expert weight-gradient GEMM: a [block_i, block_j] tile of dW[e], reduced over the
    expert's rows block_p at a time. `persistent`: one program per SM walking the tiles with both operands through
    tensor descriptors (backward/weight_grads.py; planner.weight_grad_kernel says where it can run)."""

    block_i: int
    block_j: int
    block_p: int
    num_warps: int = 4
    num_stages: int = 3
    persistent: bool = False


PERSISTENT_WEIGHT_GRAD_TILE = WeightGradTile(128, 256, 32, num_warps=8, num_stages=4, persistent=True)


# Rows per expert from which the persistent kernel beat the pointer kernel on the H200 (docs/versions.md, v14);
# below, it lost.
PERSISTENT_WEIGHT_GRAD_MIN_ROWS = 1024


def select_weight_grad_tile(device: torch.device, dtype: torch.dtype, rows_per_expert: int = 0) -> WeightGradTile:
    """Tile of the weight-gradient GEMMs (a fixed choice per backend until it is tuned like the forward's);
    rows_per_expert = T * top_k / E."""
    if not on_gpu(device):
        return WeightGradTile(32, 32, 16, persistent=True)  # the interpreter: few, small programs (and the CPU suite
        # runs the persistent kernel, as the H200 does)
    wide = torch.empty((), dtype=dtype).element_size() <= 2
    if wide and has_tma(device) and rows_per_expert >= PERSISTENT_WEIGHT_GRAD_MIN_ROWS:
        # The persistent descriptor kernel at the H200's best bf16 tile (docs/performance.md, "Tile tables")
        return PERSISTENT_WEIGHT_GRAD_TILE
    # The pointer kernel at the H200's best bf16 tile (scripts/tune --path backward); fp32 halves block_p so a stage
    # keeps its bytes, and AMD's 64 KB of LDS holds two stages.
    return WeightGradTile(128, 128, 32 if wide else 16, num_warps=4, num_stages=2 if is_hip() else 4)


# Stages of the backward's dA GEMM on Hopper: it streams one weight tile per K step to the forward gate/up GEMM's two,
# so the forward's tile holds more stages in the same shared memory (faster on the H200: docs/versions.md, v15).
DOWN_GRAD_STAGES = 4


def select_down_grad_tile(device: torch.device, gate_up: GemmTile, block_m: int, itemsize: int) -> GemmTile:
    """The dA GEMM's tile (backward/experts.py's `_down_grad_kernel`): the forward's gate_up tile, with
    DOWN_GRAD_STAGES stages on Hopper where they fit the device's shared memory; elsewhere (SM80, AMD, the
    interpreter; not measured) the forward's own."""
    stage_bytes = (block_m + gate_up.block_n) * gate_up.block_k * itemsize
    smem = smem_per_program(device) if has_wgmma(device) and on_gpu(device) else None
    if smem is None or gate_up.num_stages >= DOWN_GRAD_STAGES or DOWN_GRAD_STAGES * stage_bytes > smem:
        return gate_up
    return dataclasses.replace(gate_up, num_stages=DOWN_GRAD_STAGES)


# Devices without a table of their own that another device's table serves: the H100 is the H200's SM90 with the
# same SM count and shared memory (less memory bandwidth). Measured on an H100 with the H200's table against
# configs/default.json (docs/performance.md, "Tile tables"): bf16 experts forward + backward 1.06-1.40x faster, the
# bf16 and FP8 forwards at T = 1-4096 1.02-1.67x faster in 20 of 21 cells.
TABLE_ALIASES = {"NVIDIA_H100": "NVIDIA_H200"}


@functools.lru_cache(maxsize=None)
def table_path(key: str) -> str:
    """configs/<key>.json; else the longest table name that prefixes the key (`NVIDIA_A100` serves
    `NVIDIA_A100_SXM4_80GB`); else the table a `TABLE_ALIASES` name prefixing the key points to; else
    configs/default.json (logged once)."""
    names = sorted((f[:-5] for f in os.listdir(_CONFIG_DIR) if f.endswith(".json")), key=len, reverse=True)
    for name in names + sorted(TABLE_ALIASES, key=len, reverse=True):
        if key == name or key.startswith(name + "_"):
            return os.path.join(_CONFIG_DIR, f"{TABLE_ALIASES.get(name, name)}.json")
    _log.info("moe_dispatch: no tile table for %s, using configs/default.json", key)
    return os.path.join(_CONFIG_DIR, "default.json")


@functools.lru_cache(maxsize=None)
def load_table(key: str) -> dict:
    """The tile table for a device key (see `table_path`)."""
    path = table_path(key)
    with open(path) as f:
        return json.load(f)


def _wide_k(block_k, dtype):
    """Tables are measured with 2-byte elements; for fp32, BLOCK_K is halved so a stage keeps the same bytes."""
    return max(16, block_k // 2) if dtype.itemsize > 2 else block_k


def _pick_bucket(buckets, rows_per_expert):
    for bucket in buckets:
        if rows_per_expert <= bucket["max_rows_per_expert"]:
            return bucket
    return buckets[-1]


def select_tiles(device: torch.device, num_tokens: int, top_k: int, num_experts: int, ffn: int, hidden: int,
                 dtype: torch.dtype = torch.bfloat16, *, mxfp4: bool = False) -> MoeTiles:
    """Tiles for a forward of `num_tokens` tokens on `device` (host-side arithmetic only, no device reads).

    Tables are measured with 2-byte elements; for fp32, BLOCK_K is halved so a stage keeps the same bytes of shared
    memory (the full tile would not fit the pipeline on the H200; `_wide_k`). MXFP4 weights (`mxfp4`) read the
    table's "mxfp4" buckets of the shape where it has them, else the float weights' buckets.
    """
    table = load_table(device_key(device))
    key = f"{num_experts},{ffn},{hidden}"
    section = table.get("mxfp4", {}) if mxfp4 else {}
    buckets = (section.get("shapes", {}).get(key) or section.get("buckets")
               or table.get("shapes", {}).get(key, table["buckets"]))
    rows_per_expert = -(-num_tokens * top_k // num_experts)
    tiles = MoeTiles.from_dict(_pick_bucket(buckets, rows_per_expert))
    if dtype.itemsize <= 2:
        return tiles
    gate_up, down = (dataclasses.replace(g, block_k=_wide_k(g.block_k, dtype)) for g in (tiles.gate_up, tiles.down))
    return dataclasses.replace(tiles, gate_up=gate_up, down=down)


# The decode down GEMM of transposed down weights ([E, F, H], H contiguous: GPT-OSS's layout), by the number of
# assignments (up to, then the rest): the dot kernel reads [BLOCK_K, BLOCK_N] tiles whole where the tables' GEMV tiles,
# measured on [E, H, F], would read BLOCK_N elements per K row (faster on the H200 up to 16 assignments:
# docs/versions.md, v19; past them, and on other devices, not measured).
TRANSPOSED_DOWN_DECODE_TILES = ((4, DecodeTile(64, 64, num_warps=4, num_stages=3, split_k=2, dot=True)),
                                (None, DecodeTile(128, 64, num_warps=4, num_stages=3, dot=True)))


def transposed_down_decode_tile(num_assignments: int) -> DecodeTile:
    """The decode down tile for transposed down weights (TRANSPOSED_DOWN_DECODE_TILES)."""
    return next(tile for limit, tile in TRANSPOSED_DOWN_DECODE_TILES if limit is None or num_assignments <= limit)


# The decode down tile of MXFP4 down weights ([E, H, F / 2] bytes) on devices whose table has no MXFP4 decode entry:
# the dot kernel, BLOCK_K 128 (four scale groups, 64 bytes of a row per step); the same split rule as the transposed tiles above. Not
# tuned: chosen before any measurement.
MXFP4_DOWN_DECODE_TILES = ((4, DecodeTile(64, 128, num_warps=4, num_stages=3, split_k=2, dot=True)),
                           (None, DecodeTile(128, 128, num_warps=4, num_stages=3, dot=True)))


def select_decode_tiles(device: torch.device, num_tokens: int, top_k: int, num_experts: int, ffn: int, hidden: int,
                        dtype: torch.dtype = torch.bfloat16, *, fp8: bool = False,
                        transposed: bool = False, mxfp4: bool = False) -> DecodeTiles | None:
    """The decode path's tiles for this problem from the device's table, or None when the table gives it none (no
    `decode` entry, or N = num_tokens * top_k past its last bucket). float8 weights (`fp8`) read the "fp8" section's
    own `decode` entry (half the weight bytes move the point where the path stops winning); MXFP4 weights (`mxfp4`)
    read the "mxfp4" section's where the table has one, else the
    "fp8" one with the down tile of MXFP4_DOWN_DECODE_TILES. `transposed` weights take the down tile of
    TRANSPOSED_DOWN_DECODE_TILES for float weights. Host-side arithmetic only."""
    table = load_table(device_key(device))
    if mxfp4 and "decode" in table.get("mxfp4", {}):
        return _table_decode_tiles(table["mxfp4"]["decode"], num_tokens, top_k, num_experts, ffn, hidden, dtype)
    decode = table.get("fp8", {}).get("decode") if fp8 or mxfp4 else table.get("decode")
    tiles = _table_decode_tiles(decode, num_tokens, top_k, num_experts, ffn, hidden, dtype)
    if tiles is not None and mxfp4:
        num_assignments = num_tokens * top_k
        return DecodeTiles(tiles.gate_up, next(tile for limit, tile in MXFP4_DOWN_DECODE_TILES
                                               if limit is None or num_assignments <= limit))
    if tiles is None or not transposed or fp8:
        return tiles
    down = transposed_down_decode_tile(num_tokens * top_k)
    return DecodeTiles(tiles.gate_up, down if dtype.itemsize <= 2 else dataclasses.replace(
        down, block_k=_wide_k(down.block_k, dtype)))


def _table_decode_bucket(decode, num_tokens, top_k, num_experts, ffn, hidden) -> dict | None:
    """The bucket of a table's `decode` entry (None: no entry) for this problem, or None past its buckets."""
    if decode is None:
        return None
    buckets = decode.get("shapes", {}).get(f"{num_experts},{ffn},{hidden}", decode["buckets"])
    return next((bucket for bucket in buckets if num_tokens * top_k <= bucket["max_assignments"]), None)


def _table_decode_tiles(decode, num_tokens, top_k, num_experts, ffn, hidden, dtype) -> DecodeTiles | None:
    """The tiles of a table's `decode` entry (None: no entry) for this problem, or None past its buckets."""
    bucket = _table_decode_bucket(decode, num_tokens, top_k, num_experts, ffn, hidden)
    if bucket is None:
        return None
    tiles = DecodeTiles.from_dict(bucket)
    if dtype.itemsize <= 2:
        return tiles
    return DecodeTiles(*(dataclasses.replace(d, block_k=_wide_k(d.block_k, dtype)) for d in (tiles.gate_up, tiles.down)))


AUTO_W8A8 = "w8a8"  # an FP8 decode bucket's "auto" value: fp8_compute="auto" runs w8a8 there


def fp8_auto_takes_w8a8(device: torch.device, num_tokens: int, top_k: int, num_experts: int, ffn: int,
                        hidden: int) -> bool:
    """Whether the table's FP8 decode bucket for this problem says `"auto": "w8a8"`: where forced w8a8 measured
    faster than the weight-only decode path, `fp8_compute="auto"` runs w8a8 and the bucket's decode tiles serve
    `fp8_compute="dequant"` alone. False past the buckets and in tables without the entry. Host-side arithmetic only."""
    decode = load_table(device_key(device)).get("fp8", {}).get("decode")
    bucket = _table_decode_bucket(decode, num_tokens, top_k, num_experts, ffn, hidden)
    return bucket is not None and bucket.get("auto") == AUTO_W8A8


def select_fp8_tiles(device: torch.device, num_tokens: int, top_k: int, num_experts: int, ffn: int,
                     hidden: int) -> MoeTiles:
    """Tiles of the w8a8 FP8 path (before `gemm.w8a8.w8a8_tiles` fixes its groups): the table's "fp8" buckets, else
    its bf16 buckets with BLOCK_K 128 (one K step of 128 fp8 bytes = DeepSeek-V3's activation group) and the pointer
    kernel (`persistent` measured for bf16 says nothing of the FP8 kernel: an "fp8" section opts in)."""
    table = load_table(device_key(device))
    rows_per_expert = -(-num_tokens * top_k // num_experts)
    fp8 = table.get("fp8")
    if fp8 is not None:
        buckets = fp8.get("shapes", {}).get(f"{num_experts},{ffn},{hidden}", fp8["buckets"])
        return MoeTiles.from_dict(_pick_bucket(buckets, rows_per_expert))
    buckets = table.get("shapes", {}).get(f"{num_experts},{ffn},{hidden}", table["buckets"])
    tiles = MoeTiles.from_dict(_pick_bucket(buckets, rows_per_expert))
    return dataclasses.replace(tiles, gate_up=dataclasses.replace(tiles.gate_up, block_k=128, persistent=Persistent.OFF),
                               down=dataclasses.replace(tiles.down, block_k=128, persistent=Persistent.OFF))
