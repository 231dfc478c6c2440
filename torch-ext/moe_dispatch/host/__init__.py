"""The host side every stage stands on: device facts, argument checks, the tile tables, operator registration and the
eager launch path. No Triton kernel lives here.

  device.py     device facts in one place (backend, SM count, shared memory, TMA/wgmma, FP8 tensor cores), and the
                package's environment switches (MOE_DISPATCH_*), read and validated once per call
  checks.py     argument validation shared by the public entry points (every error names its argument)
  host_math.py  integer helpers of the launchers (cdiv, next_power_of_2) as plain Python
  library.py    torch.library plumbing: custom operators under the build's namespace (`_ops.py`), when a call goes
                through one
  pdl.py        programmatic dependent launch (Hopper): launch options and the jit calls kernels make
  tiles.py      the tile tables (configs/*.json) and the tile types (`MoeTiles`, `DecodeTiles`, ...)
  replay.py     the eager host path: a call recorded once per input signature, then replayed through Triton's compiled
                launchers (`launch`, the one way the package starts a kernel; `PlanCache`)
"""
