"""Integer helpers of the launchers, as plain Python.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in recent Triton (3.5 on), callable from kernels
too, and cost a few microseconds per call from the host; a forward makes about ten such calls before its launches.
These give the same values (tests/test_tiles.py compares them)."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (b > 0)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1; 0 for n = 0 (as triton.next_power_of_2)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
