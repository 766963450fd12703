"""Import Triton if it is there; otherwise stand-ins that let the kernel modules import on CPU-only machines.

Kernel bodies are only traced by Triton; without it the `@triton.jit` functions become stubs that
raise if called, and every dispatcher routes to the PyTorch reference instead.
"""


import os

try:  # pragma: no cover - exercised on GPU machines only
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter has no libdevice; numpy math instead

        class _InterpreterMath:
            def __getattr__(self, name):  # looked up at call time, after the interpreter patches tl
                return getattr(tl, name)

        libdevice = _InterpreterMath()

    HAS_TRITON = True
except ImportError:  # CPU CI: no triton
    HAS_TRITON = False

    class _Unavailable:
        """Stand-in for a Triton kernel on a machine without Triton."""

        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError(f"{self.fn.__name__} needs Triton; install triton or use the reference path")

        def __call__(self, *args, **kwargs):
            raise RuntimeError(f"{self.fn.__name__} needs Triton; install triton or use the reference path")

    class _TritonStub:
        @staticmethod
        def jit(fn=None, **_kwargs):
            return _Unavailable(fn) if fn is not None else _Unavailable

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 1 << (n - 1).bit_length()

    class _TLStub:
        constexpr = object  # only used in annotations

    triton = _TritonStub()
    tl = _TLStub()
    libdevice = None


def use_triton(*tensors) -> bool:
    """True when Triton is importable and every tensor given lives on a CUDA device."""
    return HAS_TRITON and all(t is None or t.is_cuda for t in tensors)


# Every Beam kernel is launched with FMA contraction off: the references round each FP32 mul and add
# separately (PyTorch eager runs them as separate kernels), and a fused a*b+c rounds once. And with
# libdevice's flush-to-zero off: ATen keeps subnormals, while Triton's default (`enable_reflect_ftz`)
# makes libdevice's div_rn / rcp_rn flush them to zero, which would change silu(g) for the bf16 gates
# with a subnormal quotient and sigmoid(g) near g = -88 (tests/gpu checks every bf16 bit pattern).
LAUNCH_OPTS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}
