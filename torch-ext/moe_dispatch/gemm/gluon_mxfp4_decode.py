"""The decode path's two kernels for MXFP4 weights on mma.sync tensor cores (Gluon, Triton 3.6; gemm/decode.py runs
them where a tile table's decode tile says `mma`).

Each weight tile of an expert is decoded once for every token that picked the expert. One program per (assignment,
tile of weight rows) is launched; the program of the first assignment naming an expert owns it, collects the
assignments naming it (its slots, up to BLOCK_T a pass) and computes sums[rows, slots] = W[e][rows, :] @ B[slots, :]^T
as an mma.sync m16n8k16 chain: the decoded weights are the A operand, straight from registers, and B is x's rows of
the slots' tokens (gate/up) or the slots' intermediate rows (down). Programs of other assignments exit. The GEMVs
(gemm/decode.py's GEMV forms) convert and multiply each weight value once per assignment on the CUDA cores; here the
conversion is paid once per expert hit and the multiply on the tensor cores.

No shared memory in the K loop: a thread loads 16 consecutive bytes of a weight row (one 128-bit load of four words:
one scale group, 32 values) for rows r and r + 8 of its warp, and a K step is 128 values (a row's 64 bytes over the 4
lanes of a quad). The mma's A fragment wants a thread to hold K values 2c, 2c + 1 (+ 8, + 16 ..) of each 16 (c = lane
% 4), which are not consecutive in memory; but a dot product does not depend on the order of its K terms, so the K step
is summed in a permuted order in which the thread's 32 consecutive values ARE its fragment: value 32 c + 4 o + 2 p + n
of the step is term K' = 16 o + 8 p + 2 c + n of the mma (o the byte pair, p its byte, n the nibble). B is loaded
under the same permutation: a lane's 32 consecutive values of its slot's row, 64 bytes. Each word of bytes decodes
through three prmt tables (E2M1_WORDS_PTX: the bf16 high and low bytes of the eight e2m1 magnitudes, and the signs)
into four (low, high) nibble pairs, one A register each, times the e8m0 scale. The weights' loads run two K steps
ahead of their decode, B's one. Measured against the GEMVs (docs/performance.md, "Decode on mma.sync"): faster once
experts are shared (GPT-OSS-20B from 5 tokens, GPT-OSS-120B from 12), slower at 1-4 tokens.

Gate/up: within a warp's 16 rows, rows 0-7 are the gate rows of 8 output columns and rows 8-15 their up rows, so a
thread holds the gate and the up sum of its columns and slots and applies the bias and the activation in registers;
the intermediate rows of the slots' assignments are stored in assignment order (as gemm/decode.py's kernels store
them). Down: the sums plus the bias, times each slot's routing weight, go to the slot's fp32 partial row; the last of a
token's TOP_K assignments to arrive at a row tile's counter sums its partial rows in the order j = 0..TOP_K-1 and
stores the token's output (as gemm/decode.py's down kernels do, same partial rows and counters: reruns are
bit-identical). The gate/up kernel zeroes the counters.

Ids outside [0, E) own nothing: their intermediate rows are never written, and their down programs store a zero
partial row (or, at TOP_K = 1, a zero output row). NaN in x, the weights or a scale code 0xFF reaches the outputs of
the tokens and rows it touches through the mma (IEEE sums).
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..formats.mxfp4 import MXFP4_GROUP
from ..host.host_math import cdiv, next_power_of_2
from ..host.pdl import pdl_options, release_dependents, wait_for_producer
from ..host.replay import launch
from .gluon_ws import available, cta_barrier, e8m0_bf16, gl, gluon_jit
from .jit import Activation, apply_activation

try:
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # a Triton without Gluon: gluon_ws.available() is False and nothing here launches
    mma_v2 = None

BLOCK_K = tl.constexpr(128)  # K values per step: a row's 64 bytes, 16 to each lane of a quad (one scale group)
MMA_ROWS = 16  # weight rows per warp: one mma.sync m16n8k16's M
COUNTER_BLOCK = tl.constexpr(1024)  # counters a program of the first assignment zeroes per store


@gluon_jit
def _add(a, b):
    return a + b


@gluon_jit
def _owner(topk_ids_ptr, stride_ids_t, stride_ids_k, pid_a, E, TOP_K: gl.constexpr, BLOCK_A: gl.constexpr,
           ids_layout: gl.constexpr):
    """(expert of assignment pid_a, whether it is in [0, E), whether pid_a is the first assignment naming it, the
    assignments' ids [BLOCK_A] (-1 past N), their aranges). Ids are compared in their own width."""
    expert = gl.load(topk_ids_ptr + (pid_a // TOP_K) * stride_ids_t + (pid_a % TOP_K) * stride_ids_k)
    offs_a = gl.arange(0, BLOCK_A, layout=ids_layout)
    num_assignments = gl.num_programs(0)
    ids = gl.load(topk_ids_ptr + (offs_a // TOP_K) * stride_ids_t + (offs_a % TOP_K) * stride_ids_k,
                  mask=offs_a < num_assignments, other=-1)
    earlier = gl.sum(((ids == expert) & (offs_a < pid_a)).to(gl.int32), axis=0)
    valid = (expert >= 0) & (expert < E)
    return expert, valid, valid & (earlier == 0), ids, offs_a


@gluon_jit
def _slots(ids, offs_a, expert, first, BLOCK_T: gl.constexpr, slots_layout: gl.constexpr):
    """The assignments of slots first .. first + BLOCK_T - 1 of `expert` (the assignments naming it, in order) [BLOCK_T]
    and whether each exists (in SliceLayout(1, slots_layout))."""
    match = (ids == expert).to(gl.int32)
    rank = gl.associative_scan(match, 0, _add) - match  # matches before each assignment
    match = gl.convert_layout(match, gl.SliceLayout(0, slots_layout))
    rank = gl.convert_layout(rank, gl.SliceLayout(0, slots_layout))
    a = gl.convert_layout(offs_a, gl.SliceLayout(0, slots_layout))
    slot = first + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, slots_layout))
    hit = (gl.expand_dims(match, 0) == 1) & (gl.expand_dims(rank, 0) == gl.expand_dims(slot, 1))  # [BLOCK_T, BLOCK_A]
    assignment = gl.sum(gl.where(hit, gl.expand_dims(a, 0), 0), axis=1)
    exists = gl.sum(hit.to(gl.int32), axis=1) > 0
    return assignment, exists


def _word_pairs_ptx() -> str:
    """PTX of E2M1_WORDS_PTX: four 32-bit words of MXFP4 bytes ($16..$19, word e holding bytes 4 e .. 4 e + 3 of a
    lane's 16) and their scale as a bf16 pair ($20; $21..$23 the same) -> sixteen bf16 pairs, $j = (low nibble, high
    nibble) of byte j times the scale. Per word: the magnitudes (3 bits a nibble) select the bf16 high and low bytes
    of the eight e2m1 values from two prmt tables, the signs a 0x80 byte from a third; the bytes interleave into the
    four pairs, each multiplied by the scale (one bf16x2 fma)."""
    lines = ["{", ".reg .b32 m0, m1, s0, s1, hi0, hi1, lo0, lo1, sg0, sg1, nz, thi, tlo, tsg;",
             "mov.b32 nz, 0x80008000; mov.b32 thi, 0x3F3F3F00; mov.b32 tlo, 0xC0800000; mov.b32 tsg, 0x00008000;"]
    for e in range(4):
        word = f"${16 + e}"
        lines += [
            f"and.b32 m0, {word}, 0x77777777; and.b32 s0, {word}, 0x88888888;",
            "shr.u32 m1, m0, 16; shr.u32 s1, s0, 19; shr.u32 s0, s0, 3;",
            "prmt.b32 hi0, thi, 0x40404040, m0; prmt.b32 hi1, thi, 0x40404040, m1;",
            "prmt.b32 lo0, tlo, 0xC0804000, m0; prmt.b32 lo1, tlo, 0xC0804000, m1;",
            "prmt.b32 sg0, tsg, 0, s0; prmt.b32 sg1, tsg, 0, s1;",
            "or.b32 hi0, hi0, sg0; or.b32 hi1, hi1, sg1;",
            "prmt.b32 m0, lo0, hi0, 0x5140; prmt.b32 m1, lo0, hi0, 0x7362;",
            f"fma.rn.bf16x2 ${4 * e}, m0, $20, nz; fma.rn.bf16x2 ${4 * e + 1}, m1, $20, nz;",
            "prmt.b32 m0, lo1, hi1, 0x5140; prmt.b32 m1, lo1, hi1, 0x7362;",
            f"fma.rn.bf16x2 ${4 * e + 2}, m0, $20, nz; fma.rn.bf16x2 ${4 * e + 3}, m1, $20, nz;",
        ]
    return "\n".join(lines + ["}"])


E2M1_WORDS_PTX = tl.constexpr(_word_pairs_ptx())
E2M1_WORDS_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 16 + ["r"] * 8))  # 16 pairs out; 4 words and 4 scales in


@gluon_jit
def _b_operand(b, b_layout: gl.constexpr):
    """B's K step as loaded, [slots, 4 lanes c, 32 values] (a lane's 32 consecutive values of its slot's row: value 32
    c + 4 o + 2 p + n), -> the mma's B operand [BLOCK_K, slots] in the permuted K order K' = 16 o + 8 p + 2 c + n."""
    SLOTS: gl.constexpr = b.type.shape[0]
    b = gl.permute(gl.reshape(b, [SLOTS, 4, 8, 2, 2]), (2, 3, 1, 4, 0))  # [o, p, c, n, slots]
    return gl.convert_layout(gl.reshape(b, [BLOCK_K, SLOTS]), b_layout)


@gluon_jit
def _decode_words(words, codes, a_layout: gl.constexpr):
    """words [ROWS, 4, 4] int32 (each lane's 16 bytes of its rows as four words: one scale group), codes [ROWS, 4]
    their e8m0 codes -> the mma's A operand [ROWS, BLOCK_K] bf16 in the permuted K order, scaled."""
    ROWS: gl.constexpr = words.type.shape[0]
    bits = e8m0_bf16(codes).to(gl.uint16, bitcast=True).to(gl.int32)
    scale, words = gl.broadcast(gl.expand_dims(bits | (bits << 16), 2), words)
    # output o, element e = 2 p + n of a lane: nibble n of its byte 2 o + p
    outs = gl.inline_asm_elementwise(E2M1_WORDS_PTX, E2M1_WORDS_CONSTRAINTS, [words, scale],
                                     dtype=(gl.bfloat16, ) * 8, is_pure=True, pack=4)
    both = gl.join(gl.join(gl.join(outs[0], outs[1]), gl.join(outs[2], outs[3])),
                   gl.join(gl.join(outs[4], outs[5]), gl.join(outs[6], outs[7])))  # [rows, c, e, o0, o1, o2]
    both = gl.reshape(both, [ROWS, 4, 2, 2, 2, 2, 2])  # [rows, c, p, n, o0, o1, o2]
    both = gl.permute(both, (0, 6, 5, 4, 2, 1, 3))  # [rows, o2, o1, o0, p, c, n]: K' = 16 o + 8 p + 2 c + n
    return gl.convert_layout(gl.reshape(both, [ROWS, BLOCK_K]), a_layout)


@gluon_jit
def _expert_sums(w_rows, s_rows, row_ok, stride_s_k, b_rows, stride_b_k, slot_ok, k_begin, k_end,
                 mma_layout: gl.constexpr, words_layout: gl.constexpr, b_rows_layout: gl.constexpr):
    """sums [ROWS, BLOCK_T] fp32 (mma_layout): row r, slot n = sum over k in [k_begin, k_end) of W[r, k] * B[n, k], W
    the MXFP4 rows whose bytes start at w_rows [ROWS] (unit stride along K, 4-byte aligned) and e8m0 codes at s_rows
    [ROWS] (stride_s_k apart), rows outside row_ok read as zero; B the bf16 rows at b_rows [BLOCK_T] (stride_b_k
    apart), slots outside slot_ok zero. k_begin a multiple of BLOCK_K, k_end of 32: whole steps unmasked along K, then
    a masked last step. The weights' loads run two steps ahead of their decode, B's one."""
    ROWS: gl.constexpr = w_rows.type.shape[0]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_layout, k_width=2)
    codes_layout: gl.constexpr = gl.SliceLayout(2, words_layout)
    # the weight words [ROWS, 4 lanes, 4]: row pointers + 4 c + word; their codes [ROWS, 4]
    offs_c = gl.arange(0, 4, layout=gl.SliceLayout(0, codes_layout))
    offs_word = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, words_layout)))
    w_rows = gl.convert_layout(w_rows, gl.SliceLayout(1, codes_layout)).to(gl.pointer_type(gl.int32), bitcast=True)
    row_ok = gl.expand_dims(gl.convert_layout(row_ok, gl.SliceLayout(1, codes_layout)), 1)
    s_rows = gl.convert_layout(s_rows, gl.SliceLayout(1, codes_layout))
    w_ptrs = (gl.expand_dims(gl.expand_dims(w_rows + k_begin // 8, 1) + gl.expand_dims(offs_c * 4, 0), 2)
              + gl.expand_dims(gl.expand_dims(offs_word, 0), 1))
    s_ptrs = gl.expand_dims(s_rows + (k_begin // 32) * stride_s_k, 1) + gl.expand_dims(offs_c * stride_s_k, 0)
    # B's rows [BLOCK_T, 4 lanes, 32 values]: each lane's 32 consecutive values of its slot's row
    b_rows = gl.convert_layout(b_rows, gl.SliceLayout(1, gl.SliceLayout(2, b_rows_layout)))
    b_ok = gl.expand_dims(gl.expand_dims(gl.convert_layout(slot_ok, b_rows.type.layout), 1), 2)
    offs_bc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_rows_layout)))
    offs_value = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_rows_layout)))
    b_offs = gl.expand_dims(gl.expand_dims(offs_bc * 32, 0), 2) + gl.expand_dims(gl.expand_dims(offs_value, 0), 1)
    b_ptrs = gl.expand_dims(gl.expand_dims(b_rows + k_begin * stride_b_k, 1), 2) + b_offs * stride_b_k
    w_ok = gl.expand_dims(row_ok, 2)
    K = k_end - k_begin
    whole_steps = K // BLOCK_K

    SLOTS: gl.constexpr = b_ptrs.type.shape[0]
    acc = gl.zeros([ROWS, SLOTS], gl.float32, mma_layout)
    if whole_steps > 0:
        second = gl.minimum(1, whole_steps - 1)
        w = gl.load(w_ptrs, mask=w_ok, other=0)
        codes = gl.load(s_ptrs, mask=row_ok, other=0)
        w_then = gl.load(w_ptrs + second * (BLOCK_K // 8), mask=w_ok, other=0)
        codes_then = gl.load(s_ptrs + second * (BLOCK_K // 32) * stride_s_k, mask=row_ok, other=0)
        b = gl.load(b_ptrs, mask=b_ok, other=0.0)
        for step in range(whole_steps):
            # the loads of two steps on (the weights) and of the next (B) first, clamped to the last whole step
            # (which then loads itself again): their latency runs under this step's decode and mma
            ahead = gl.minimum(step + 2, whole_steps - 1)
            nxt = gl.minimum(step + 1, whole_steps - 1)
            w_ahead = gl.load(w_ptrs + ahead * (BLOCK_K // 8), mask=w_ok, other=0)
            codes_ahead = gl.load(s_ptrs + ahead * (BLOCK_K // 32) * stride_s_k, mask=row_ok, other=0)
            b_next = gl.load(b_ptrs + nxt * BLOCK_K * stride_b_k, mask=b_ok, other=0.0)
            acc = mma_v2(_decode_words(w, codes, a_layout), _b_operand(b, b_layout), acc)
            w = w_then
            codes = codes_then
            w_then = w_ahead
            codes_then = codes_ahead
            b = b_next
    k_last = whole_steps * BLOCK_K
    if k_last < K:  # the last step's scale groups past k_end (and B's values) read as zero
        last_ok = row_ok & gl.expand_dims(k_last + offs_c * 32 < K, 0)
        w = gl.load(w_ptrs + whole_steps * (BLOCK_K // 8), mask=gl.expand_dims(last_ok, 2), other=0)
        codes = gl.load(s_ptrs + whole_steps * (BLOCK_K // 32) * stride_s_k, mask=last_ok, other=0)
        b = gl.load(b_ptrs + k_last * stride_b_k, mask=b_ok & (k_last + b_offs < K), other=0.0)
        acc = mma_v2(_decode_words(w, codes, a_layout), _b_operand(b, b_layout), acc)
    return acc


@gluon_jit
def _zero_counters(counter_ptr, num_counters, pid_n, layout: gl.constexpr):
    """Program (0, pid_n)'s slice of the down kernel's arrival counters, zeroed."""
    per_program = gl.cdiv(num_counters, gl.num_programs(1))
    end = gl.minimum((pid_n + 1) * per_program, num_counters)
    for c0 in range(pid_n * per_program, end, COUNTER_BLOCK):
        offs = c0 + gl.arange(0, COUNTER_BLOCK, layout=layout)
        gl.store(counter_ptr + offs, gl.zeros([COUNTER_BLOCK], gl.int32, layout), mask=offs < end)


@gluon_jit
def _gate_up_kernel(x_ptr, stride_x_t, stride_x_h,
                    w_gate_ptr, w_up_ptr, stride_w_e, stride_w_n,
                    s_gate_ptr, s_up_ptr, stride_s_e, stride_s_n, stride_s_k,
                    bias_gate_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
                    inter_ptr, stride_inter_a,
                    topk_ids_ptr, stride_ids_t, stride_ids_k,
                    counter_ptr, num_counters,
                    F, H, E, alpha, limit,
                    TOP_K: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_T: gl.constexpr,
                    BLOCK_A: gl.constexpr, mma_layout: gl.constexpr, words_layout: gl.constexpr,
                    ids_layout: gl.constexpr, slots_layout: gl.constexpr, b_rows_layout: gl.constexpr,
                    PDL: gl.constexpr):
    """Grid (N, cdiv(F, 8 * num_warps)): program (a, n) owns columns [n * 8 W, +8 W) of the intermediate for the
    expert of assignment a when a is the first naming it (module docstring); W x 16 weight rows, warp w's rows 0-7
    the gate rows of columns 8 w .. 8 w + 7 and rows 8-15 their up rows."""
    ROWS: gl.constexpr = mma_layout.warps_per_cta[0] * 16
    COLS: gl.constexpr = ROWS // 2
    wait_for_producer(PDL)
    pid_a = gl.program_id(0)
    pid_n = gl.program_id(1)
    if pid_a == 0:  # the first assignment's programs zero the counters, a slice each, before any can exit
        _zero_counters(counter_ptr, num_counters, pid_n, ids_layout)
    expert, valid, owner, ids, offs_a = _owner(topk_ids_ptr, stride_ids_t, stride_ids_k, pid_a, E, TOP_K, BLOCK_A,
                                               ids_layout)
    if owner:
        rows = gl.arange(0, ROWS, layout=ids_layout)
        is_up = (rows // 8) % 2 == 1
        cols = pid_n * COLS + (rows // 16) * 8 + rows % 8
        row_ok = cols < F
        w_rows = (gl.where(is_up, w_up_ptr, w_gate_ptr) + expert.to(gl.int64) * stride_w_e
                  + cols.to(gl.int64) * stride_w_n)
        s_rows = (gl.where(is_up, s_up_ptr, s_gate_ptr) + expert.to(gl.int64) * stride_s_e
                  + cols.to(gl.int64) * stride_s_n)
        count = gl.sum((ids == expert).to(gl.int32), axis=0)
        for first in range(0, count, BLOCK_T):
            assignment, exists = _slots(ids, offs_a, expert, first, BLOCK_T, slots_layout)
            x_rows = x_ptr + (assignment // TOP_K).to(gl.int64) * stride_x_t
            sums = _expert_sums(w_rows, s_rows, row_ok, stride_s_k, x_rows, stride_x_h, exists, 0, H, mma_layout,
                                words_layout, b_rows_layout)
            release_dependents(PDL)
            # [W, 2, 8, slots] -> the gate and the up sums [8 W, slots] of the same columns, in each thread
            halves = gl.permute(gl.reshape(sums, [ROWS // 16, 2, 8, BLOCK_T]), (0, 2, 3, 1))
            gate, up = gl.split(halves)
            gate = gl.reshape(gate, [COLS, BLOCK_T])
            up = gl.reshape(up, [COLS, BLOCK_T])
            out_layout: gl.constexpr = gate.type.layout
            out_cols = pid_n * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(1, out_layout))
            cols_ok = out_cols < F
            if HAS_BIAS:
                bias_offs = expert.to(gl.int64) * stride_bias_e + out_cols * stride_bias_n
                b_gate = gl.load(bias_gate_ptr + bias_offs, mask=cols_ok, other=0.0)
                b_up = gl.load(bias_up_ptr + bias_offs, mask=cols_ok, other=0.0)
                gate = gate + gl.expand_dims(b_gate.to(gl.float32), 1)
                up = up + gl.expand_dims(b_up.to(gl.float32), 1)
            h = apply_activation(gate, up, alpha, limit, ACTIVATION).to(inter_ptr.dtype.element_ty)
            out_assignment = gl.convert_layout(assignment, gl.SliceLayout(0, out_layout))
            out_exists = gl.convert_layout(exists, gl.SliceLayout(0, out_layout))
            inter_ptrs = (inter_ptr + gl.expand_dims(out_assignment.to(gl.int64) * stride_inter_a, 0)
                          + gl.expand_dims(out_cols, 1))
            gl.store(inter_ptrs, h, mask=gl.expand_dims(cols_ok, 1) & gl.expand_dims(out_exists, 0))


@gluon_jit
def _down_kernel(inter_ptr, stride_inter_a,
                 w_ptr, stride_w_e, stride_w_n,
                 s_ptr, stride_s_e, stride_s_n, stride_s_k,
                 bias_ptr, stride_bias_e, stride_bias_n,
                 topk_ids_ptr, stride_ids_t, stride_ids_k,
                 topk_weights_ptr, stride_tw_t, stride_tw_k,
                 partial_ptr, counter_ptr,
                 out_ptr, stride_out_t, stride_out_h,
                 H, F, E,
                 TOP_K: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_T: gl.constexpr,
                 BLOCK_A: gl.constexpr, mma_layout: gl.constexpr, words_layout: gl.constexpr,
                 ids_layout: gl.constexpr, slots_layout: gl.constexpr, b_rows_layout: gl.constexpr,
                 PDL: gl.constexpr):
    """Grid (N, cdiv(H, 16 * num_warps)): program (a, n) owns output columns [n * ROWS, +ROWS) for the expert of
    assignment a when a is the first naming it; the program of an assignment whose id is outside [0, E) adds a zero
    row for it. partial [N, H] fp32; counter [T * cdiv(H, ROWS)], zeroed by the gate/up kernel. (Splitting F over
    more programs measured no faster: docs/performance.md, "Decode on mma.sync".)"""
    ROWS: gl.constexpr = mma_layout.warps_per_cta[0] * 16
    wait_for_producer(PDL)
    pid_a = gl.program_id(0)
    pid_n = gl.program_id(1)
    expert, valid, owner, ids, offs_a = _owner(topk_ids_ptr, stride_ids_t, stride_ids_k, pid_a, E, TOP_K, BLOCK_A,
                                               ids_layout)
    if valid == 0:
        _down_store(gl.zeros([ROWS, BLOCK_T], gl.float32, mma_layout), pid_a + gl.zeros([BLOCK_T], gl.int32,
                    gl.SliceLayout(0, mma_layout)), gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, mma_layout)) == 0,
                    pid_n, partial_ptr, counter_ptr, out_ptr, stride_out_t, stride_out_h, H, TOP_K)
    elif owner:
        rows = pid_n * ROWS + gl.arange(0, ROWS, layout=ids_layout)
        row_ok = rows < H
        w_rows = w_ptr + expert.to(gl.int64) * stride_w_e + rows.to(gl.int64) * stride_w_n
        s_rows = s_ptr + expert.to(gl.int64) * stride_s_e + rows.to(gl.int64) * stride_s_n
        count = gl.sum((ids == expert).to(gl.int32), axis=0)
        for first in range(0, count, BLOCK_T):
            assignment, exists = _slots(ids, offs_a, expert, first, BLOCK_T, slots_layout)
            inter_rows = inter_ptr + assignment.to(gl.int64) * stride_inter_a
            sums = _expert_sums(w_rows, s_rows, row_ok, stride_s_k, inter_rows, 1, exists, 0, F, mma_layout,
                                words_layout, b_rows_layout)
            release_dependents(PDL)
            out_rows = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_layout))
            if HAS_BIAS:
                bias = gl.load(bias_ptr + expert.to(gl.int64) * stride_bias_e + out_rows * stride_bias_n,
                               mask=out_rows < H, other=0.0)
                sums = sums + gl.expand_dims(bias.to(gl.float32), 1)
            slot_assignment = gl.convert_layout(assignment, gl.SliceLayout(0, mma_layout))
            slot_exists = gl.convert_layout(exists, gl.SliceLayout(0, mma_layout))
            weight = gl.load(topk_weights_ptr + (slot_assignment // TOP_K) * stride_tw_t
                             + (slot_assignment % TOP_K) * stride_tw_k, mask=slot_exists, other=0.0)
            sums = sums * gl.expand_dims(weight.to(gl.float32), 0)
            _down_store(sums, slot_assignment, slot_exists, pid_n, partial_ptr, counter_ptr, out_ptr, stride_out_t,
                        stride_out_h, H, TOP_K)


@gluon_jit
def _down_store(sums, assignment, exists, pid_n, partial_ptr, counter_ptr, out_ptr, stride_out_t, stride_out_h, H,
                TOP_K: gl.constexpr):
    """The weighted sums [ROWS, slots] of assignments `assignment` (where `exists`): out[t] directly at TOP_K = 1;
    else each slot's partial row, then its arrival at the (token, row tile) counter, and the token's sum over its
    TOP_K partial rows in order by the last to arrive."""
    ROWS: gl.constexpr = sums.type.shape[0]
    layout: gl.constexpr = sums.type.layout
    rows = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    rows_ok = gl.expand_dims(rows < H, 1)
    token = assignment // TOP_K
    out_ptrs = (out_ptr + gl.expand_dims(token.to(gl.int64) * stride_out_t, 0)
                + gl.expand_dims(rows * stride_out_h, 1))
    if TOP_K == 1:
        gl.store(out_ptrs, sums.to(out_ptr.dtype.element_ty), mask=rows_ok & gl.expand_dims(exists, 0))
    else:
        gl.store(partial_ptr + gl.expand_dims(assignment.to(gl.int64) * H, 0) + gl.expand_dims(rows, 1), sums,
                 mask=rows_ok & gl.expand_dims(exists, 0))
        # every thread's partials are written before the arrivals are counted (the barrier, then the atomics'
        # release); the last arrival's acquire makes the other programs' partials visible to its loads
        cta_barrier()
        num_tiles = gl.cdiv(H, ROWS)
        arrived = gl.atomic_add(counter_ptr + token * num_tiles + pid_n, gl.full_like(token, 1), mask=exists,
                                sem="acq_rel")
        last = exists & (arrived == TOP_K - 1)
        total = gl.zeros_like(sums)
        mask = rows_ok & gl.expand_dims(last, 0)
        for j in gl.static_range(TOP_K):
            total += gl.load(partial_ptr + gl.expand_dims((token * TOP_K + j).to(gl.int64) * H, 0)
                             + gl.expand_dims(rows, 1), mask=mask, other=0.0, cache_modifier=".cg")
        gl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


def _layouts(num_warps: int, block_t: int):
    """(mma, words, ids, slots, b_rows) layouts for programs of `num_warps` warps (16 weight rows each) and block_t
    slots."""
    warp_bases = [[MMA_ROWS << i, 0, 0] for i in range(num_warps.bit_length() - 1)]
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    # [rows, 4 lanes of a quad, 4 words]: lane 4 g + c holds bytes 16 c .. 16 c + 15 of rows g and g + 8 of its warp
    words = gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
                                       lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                       warp_bases=warp_bases, block_bases=[], shape=[MMA_ROWS * num_warps, 4, 4])
    ids = gl.BlockedLayout([1], [32], [num_warps], [0])
    slots = gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])
    # [slots, 4 lanes of a quad, 32 values]: lane 4 g + c holds values 32 c .. 32 c + 31 of slot g (and g + 8, ..),
    # every warp the same (B is each warp's whole operand)
    b_rows = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16]] + [[8 << i, 0, 0] for i in range(
            (block_t // 8).bit_length() - 1)],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[0, 0, 0]] * (num_warps.bit_length() - 1), block_bases=[], shape=[block_t, 4, 32])
    return mma, words, ids, slots, b_rows


def runs(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> bool:
    """Whether these kernels take a decode call's weight w: MXFP4 bytes read along their rows as 32-bit words (unit
    stride along K, every row 4-byte aligned), bf16 x, a GPU where the Gluon kernels run."""
    return (w.dtype == torch.uint8 and x.dtype == torch.bfloat16 and not transposed and w.stride(-1) == 1
            and w.data_ptr() % 4 == 0 and all(stride % 4 == 0 for stride in w.stride()[:-1])
            and x.device.type == "cuda" and available(x.device))


def rows_per_program(num_warps: int) -> int:
    """Weight rows of one program: 16 a warp (the gate/up kernel's are 8 W output columns' gate and up rows)."""
    return MMA_ROWS * num_warps


def gate_up_views(w_gate, w_up, scale, up_row_offset, gate_bias, up_bias, paired):
    """(w_gate, w_up, s_gate, s_up, gate_bias, up_bias) as the gate/up kernel reads them, the gate rows and the up
    rows apart: `paired` (one interleaved weight, gate rows even) by strided views, else the up scale codes from
    row up_row_offset of `scale` (MXFP4 scales step one row per column)."""
    if paired:
        biases = (gate_bias[:, 0::2], gate_bias[:, 1::2]) if gate_bias is not None else (None, None)
        return w_gate[:, 0::2], w_gate[:, 1::2], scale[:, 0::2], scale[:, 1::2], *biases
    return w_gate, w_up, scale, scale[:, up_row_offset:], gate_bias, up_bias


def _launch_options(num_tokens: int, top_k: int, num_warps: int, device) -> dict:
    """The constexprs and launch options both kernels take for T * top_k assignments and programs of num_warps warps:
    TOP_K, BLOCK_T (`mma_block_t`), BLOCK_A (>= the assignments), the layouts (`_layouts`), num_warps, PDL."""
    num_assignments = num_tokens * top_k
    block_t = mma_block_t(num_assignments)
    mma, words, ids, slots, b_rows = _layouts(num_warps, block_t)
    return dict(TOP_K=top_k, BLOCK_T=block_t, BLOCK_A=max(32, next_power_of_2(num_assignments)), mma_layout=mma,
                words_layout=words, ids_layout=ids, slots_layout=slots, b_rows_layout=b_rows, num_warps=num_warps,
                **pdl_options(device))


def mma_block_t(num_assignments: int) -> int:
    """An owner's slots per pass: 8 (one mma n8) up to 64 assignments, else 16 (an owner with more slots makes more
    passes, each reading its weight tile again)."""
    return 8 if num_assignments <= 64 else 16


def gate_up_mma(x, w_gate, w_up, s_gate, s_up, gate_bias, up_bias, intermediate, topk_ids, counters, *, activation,
                alpha, limit, num_warps):
    """The gate/up kernel (module docstring) into intermediate [N, F]: x [T, H] bf16; w_gate, w_up the MXFP4 bytes
    [E, F, H / 2] (unit stride along H, the same strides), s_gate, s_up their e8m0 codes [E, F, H / 32] (the same
    strides), gate_bias, up_bias [E, F] or None; counters the down kernel's, zeroed here."""
    T, H = x.shape
    top_k = topk_ids.shape[1]
    E, F = w_gate.shape[0], w_gate.shape[1]
    launch(_gate_up_kernel, (T * top_k, cdiv(F, 8 * num_warps)),
           x, x.stride(0), x.stride(1),
           w_gate, w_up, w_gate.stride(0), w_gate.stride(1),
           s_gate, s_up, s_gate.stride(0), s_gate.stride(1), s_gate.stride(2),
           gate_bias, up_bias, *(gate_bias.stride() if gate_bias is not None else (0, 0)),
           intermediate, intermediate.stride(0),
           topk_ids, topk_ids.stride(0), topk_ids.stride(1),
           counters, counters.numel(),
           F, H, E, float(alpha), float(limit),
           ACTIVATION=int(Activation.of(activation)), HAS_BIAS=gate_bias is not None,
           **_launch_options(T, top_k, num_warps, x.device))


def down_mma(intermediate, w_down, s_down, down_bias, topk_ids, topk_weights, partial, counters, out, *, num_warps):
    """The down kernel (module docstring) into out [T, H]: intermediate [N, F] bf16, w_down the MXFP4 bytes [E, H,
    F / 2] (unit stride along F), s_down their codes [E, H, F / 32]; partial [N, H] fp32 (TOP_K > 1); counters [T *
    cdiv(H, 16 * num_warps)], zeroed by the gate/up kernel."""
    T, H = out.shape
    top_k = topk_ids.shape[1]
    E, F = w_down.shape[0], intermediate.shape[1]
    launch(_down_kernel, (T * top_k, cdiv(H, rows_per_program(num_warps))),
           intermediate, intermediate.stride(0),
           w_down, w_down.stride(0), w_down.stride(1),
           s_down, s_down.stride(0), s_down.stride(1), s_down.stride(2),
           down_bias, *(down_bias.stride() if down_bias is not None else (0, 0)),
           topk_ids, topk_ids.stride(0), topk_ids.stride(1),
           topk_weights, topk_weights.stride(0), topk_weights.stride(1),
           partial, counters,
           out, out.stride(0), out.stride(1),
           H, F, E,
           HAS_BIAS=down_bias is not None, **_launch_options(T, top_k, num_warps, out.device))
