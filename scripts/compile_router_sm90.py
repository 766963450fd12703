"""Compile the router's Triton kernels for sm_90 (H200) without a GPU, with whichever Triton is first on
the path, to learn before a device session which GEMM variant that Triton can build:

    pip download triton==3.6.0 --no-deps -d /tmp/tri && pip install --no-deps --target /tmp/tri36 /tmp/tri/triton-*.whl
    PYTHONPATH=/tmp/tri36 python scripts/compile_router_sm90.py      # the H200 image's Triton 3.6

Prints OK / FAIL per kernel and configuration (the FP64 `tl.dot` variant and the broadcast-multiply
variant of `_router_gemm_kernel`, the route and replay `_router_topk_kernel`).
"""

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from beam_rl.kernels import router_ops

TARGET = GPUTarget("cuda", 90, 32)


def try_compile(label: str, fn, signature: dict, constexprs: dict, num_warps: int = 4) -> None:
    try:
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET, options={"num_warps": num_warps})
        print(f"{label}: OK")
    except Exception as err:  # noqa: BLE001 - report any compiler failure and go on
        print(f"{label}: FAIL ({type(err).__name__}: {str(err).splitlines()[0][:120]})")


def main() -> None:
    print("triton", triton.__version__)
    gemm_sig = {"x_ptr": "*bf16", "w_ptr": "*fp32", "part_ptr": "*fp64", "T": "i32", "K": "i32", "E": "i32",
                "stride_xt": "i32", "stride_we": "i32", "K_ITERS": "i32", "BLOCK_T": "constexpr", "BLOCK_E": "constexpr",
                "BLOCK_K": "constexpr", "USE_DOT": "constexpr"}
    for tokens in (1, 8, 64):
        for use_dot in (False, True):
            bt, be, bk, warps, *_ = router_ops._gemm_config(tokens, 5120, 256, None, use_dot)
            try_compile(f"gemm {'dot' if use_dot else 'broadcast'} T={tokens} (BLOCK_T={bt}, BLOCK_E={be}, BLOCK_K={bk})",
                        router_ops._router_gemm_kernel, gemm_sig, dict(BLOCK_T=bt, BLOCK_E=be, BLOCK_K=bk, USE_DOT=use_dot), warps)
    topk_sig = {"part_ptr": "*fp64", "bias_ptr": "*fp32", "ids_in_ptr": "*i64", "w_out_ptr": "*fp32", "ids_out_ptr": "*i64",
                "logits_out_ptr": "*fp32", "T": "i32", "SPLIT": "i32", "scaling": "fp32", "E": "constexpr", "NG": "constexpr",
                "TOPK_GROUP": "constexpr", "TOPK": "constexpr", "TOPK_P": "constexpr", "RENORM": "constexpr",
                "REPLAY": "constexpr", "SBW": "constexpr", "LOGITS_OUT": "constexpr"}
    for replay in (False, True):
        for experts, groups, kept, top_k in ((256, 8, 4, 8), (64, 4, 4, 8), (16, 4, 2, 4)):
            try_compile(f"topk {'replay' if replay else 'route'} E={experts}", router_ops._router_topk_kernel, topk_sig,
                        dict(E=experts, NG=groups, TOPK_GROUP=kept, TOPK=top_k, TOPK_P=top_k, RENORM=True, REPLAY=replay,
                             SBW=4, LOGITS_OUT=True))


if __name__ == "__main__":
    main()
