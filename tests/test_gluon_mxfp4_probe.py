"""benchmarks/gluon_mxfp4_probe.py, the warp-specialized Gluon GEMM with MXFP4 weights (not part of the package): on a
Hopper GPU with Gluon, its grouped GEMM against float64 on small odd sizes (an empty expert, ragged rows, a masked
column tile and K step; every row of a NaN-poisoned output written), a NaN in A reaching its own row only and a 0xFF
scale code its own column of its expert's rows only. Its sm_90 compile (registers, spills, shared memory, the wgmma
and the wait it is written for) is checked on any host by tests/test_gluon_compile.py."""

import pytest
from helpers import DEVICE

from moe_dispatch.gemm import gluon_ws


@pytest.mark.skipif(not gluon_ws.available(), reason=f"{gluon_ws.unavailable_reason()}")
def test_grouped_gemm_matches_float64_and_keeps_nans_in_place():
    import gluon_mxfp4_probe

    lines = gluon_mxfp4_probe.check_small_cases(DEVICE)
    assert len(lines) == len(gluon_mxfp4_probe.SMALL_CASES) + 1, lines
