"""Programmatic dependent launch (PDL; NVIDIA Hopper on): a kernel's programs are placed on the GPU while the
kernel before it on the stream drains, instead of after it has finished, which hides most of the gap between
back-to-back launches (a few microseconds each; the decode path is two launches of ~10-100 us, the general path
five to seven).

Every kernel launched with PDL calls `wait_for_producer` before its first access to global memory: that waits until
the previous grid on the stream has completed and its writes are visible (PTX griddepcontrol.wait), so the kernel sees
memory exactly as a plain launch would, including buffers the caching allocator hands out again in stream order.
Nothing of a kernel's own work overlaps its predecessor; only the launch does. `release_dependents` (after a
kernel's main loop) lets the next PDL kernel's programs be placed before this one's last programs finish their
epilogues.

Off on AMD, SM80 and the interpreter (the calls compile to nothing there), and when MOE_DISPATCH_PDL=0 (for A/B
measurements and as an escape hatch; read with the package's other switches, host/device.py).
"""

import torch
import triton
import triton.language as tl

from .device import capability, current_environment, is_cuda, is_interpreter, on_gpu, per_device

HAS_GDC = hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")

if HAS_GDC:

    @triton.jit
    def wait_for_producer(PDL: tl.constexpr):
        """Block until the previous grid on the stream has completed (no-op unless PDL)."""
        if PDL:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def release_dependents(PDL: tl.constexpr):
        """Allow the next grid's programs to be placed (no-op unless PDL)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

else:  # a Triton without the grid dependency intrinsics: PDL is never on (`pdl_enabled`)

    @triton.jit
    def wait_for_producer(PDL: tl.constexpr):
        pass

    @triton.jit
    def release_dependents(PDL: tl.constexpr):
        pass


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: an NVIDIA GPU of compute capability >= 9.0, a Triton with the
    intrinsics, and MOE_DISPATCH_PDL not set to 0 (the call's switches: current_environment)."""
    if not on_gpu(device) or not current_environment().pdl:
        return False
    return _pdl_capable(device)


@per_device
def _pdl_capable(device: torch.device) -> bool:
    """The device facts of `pdl_enabled`, once per device (every launch asks)."""
    return HAS_GDC and not is_interpreter() and is_cuda() and capability(device) >= (9, 0)


def pdl_options(device: torch.device) -> dict:
    """The `PDL` constexpr and launch option of a kernel that calls `wait_for_producer` first."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}
