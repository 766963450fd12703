"""FP32 MoE router: split-K FP64-accumulating GEMM for decode-size batches + grouped sigmoid top-k, and its replay.

Numerics contract: the logits are `routing.router_logits`'s, x @ W^T accumulated in FP64 and rounded
once to FP32, and the top-k epilogue is `routing.select_experts` / `replay_experts` bit for bit.

Why FP64: FP32 GEMMs that sum in different orders (a split-K kernel, cuBLAS's blocking) give logits
that differ in the last bits, which flips near-tied expert choices; a generated sequence then follows
the flipped expert, so two engines with differently ordered FP32 routers do not generate the same
tokens. An FP64
accumulation rounded once is order independent in practice (below), so every engine that computes
the logits this way agrees: this kernel, `routing.router_logits` (the trainer's router) on any
device, and so `rollout/ops.route` without the fused kernels (BEAM_RL_FUSED_KERNELS=0).

Why FP64 accumulation is (almost) order independent: a product of a BF16 (8-bit significand) or any
format up to FP32 (24 bits) and an FP32 value has at most 48 significant bits, so every x_k * w_k is
exact in FP64; the only rounding before the final one to FP32 is FP64 addition, and two summation
orders differ by at most ~K * 2^-53 * sum_k |x_k w_k| (K = hidden; measured: max 2.0e-17 of
sum|terms| at 5120 x 256, against the 5.7e-13 bound). They round to different FP32 values only if
an FP32 rounding boundary falls between their FP64 sums: E[|s_a - s_b| / ulp32] = 1e-9 per logit
(5120 x 256, BF16 x ~ N(0, 1), W ~ N(0, 1/K), 1M logits: 8.6% differ in FP64 at all, none in FP32).
That is the only way these logits can differ from cuBLAS's DGEMM (the reference on CUDA) or the
CPU BLAS's: ~0.2 one-ulp logit differences in a 16384-token prefill through all 49 MoE layers of
Beam-1.0 (2e8 logits), and such a difference changes an expert id only on a one-ulp tie.

Two launches up to TRITON_GEMM_MAX_TOKENS: (1) FP64 logit partials [split, T, E] =
x[:, k-slice] @ W[:, k-slice]^T, spread over E-blocks x K-slices so a 1-64 token call fills the GPU:
`tl.dot` on FP64 operands (Triton 3.9 lowers it to FP64 MMA, `mma.sync ... m8n8k4 ... f64`) or,
where the FP64 dot does not compile (Triton 3.6), FP64 FMAs into a [T, E, K] accumulator tile summed
over K after the loop (`_default_fp64_dot`; `_logit_partials(use_dot=...)` forces either; same
contract, both pinned by the tests); (2) one program per token sums the partials in FP64, rounds once
to FP32 and runs the epilogue with `select_experts`'s exact arithmetic: ATen's sigmoid, biased group
top-2 sums, top `topk_group` groups, top `top_k` experts (ties to the lower id), renormalised in
ATen's sum order, times the scaling factor. Given the same logits the epilogue is bit-exact.

Above TRITON_GEMM_MAX_TOKENS the logits are `routing.router_logits` itself (cuBLAS DGEMM, which runs
on the FP64 tensor cores), bit-identical to the reference by construction, then launch (2). At
prefill cuBLAS is the faster FP64 GEMM: 16384 x 5120 x 256 is 21.5 G FMA (43 GFLOP), 0.64 ms at the
H200's 67 TFLOP/s FP64 tensor-core rate, 1.3 ms at its 34 TFLOP/s FP64 FMA rate (the bound of a
non-MMA kernel); its price is the FP64 copy of x (671 MB written and read, ~0.3 ms). At decode the
cost is the weights: 5.24 MB of FP32 W read once = 1.2 us at 4.3 TB/s; 64 tokens are 84 M FMA
(168 MFLOP) = 2.5 us at the tensor-core rate, 4.9 us at the FMA rate (rooflines, not measurements).
Measured times, against cuBLAS FP32 GEMM + PyTorch top-k and against the reference (cuBLAS DGEMM +
PyTorch top-k): docs/results/kernels.md, "Router".
"""

import os
import re
import warnings
from typing import NamedTuple

import torch

from beam_rl.model import routing

from ._triton_compat import LAUNCH_OPTS, libdevice, tl, triton, use_triton
from .reduce_order import _block_x_tree, _combine4, cuda_sum_config

# Up to this many tokens the split-K Triton GEMM runs; above it `routing.router_logits` (cuBLAS DGEMM)
# computes the logits. Either way they are the reference's FP64-accumulated logits. The threshold comes
# from bench_kernels' router_5120x256 and router_5120x256_dgemm rows (docs/results/kernels.md): the Triton
# GEMM's time grows with the tokens and the DGEMM's hardly does.
TRITON_GEMM_MAX_TOKENS = 64


def _default_fp64_dot() -> bool | None:
    """FP64 `tl.dot` (True) or broadcast multiply + tl.sum (False); None: try the dot once and fall back
    on a compile failure. Triton 3.6 cannot lower an FP64 dot for sm_90 ("Currently fp64 don't support
    largeK MMA"); 3.9 lowers it to `mma.sync.aligned.m8n8k4.row.col.f64` (both checked by compiling
    for sm_90 without a GPU). BEAM_RL_ROUTER_FP64_DOT=0/1 pins the choice."""
    pinned = os.environ.get("BEAM_RL_ROUTER_FP64_DOT", "")
    if pinned in ("0", "1"):
        return pinned == "1"
    version = tuple(int(v) for v in re.findall(r"\d+", getattr(triton, "__version__", "0.0"))[:2])
    return False if version < (3, 7) else None


_FP64_DOT: bool | None = _default_fp64_dot()


@triton.jit
def _router_gemm_kernel(x_ptr, w_ptr, part_ptr, T, K, E, stride_xt, stride_we, K_ITERS,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr):
    pe = tl.program_id(0)
    pk = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    x_rows = x_ptr + t[:, None].to(tl.int64) * stride_xt
    t_ok = t[:, None] < T
    k = pk * K_ITERS * BLOCK_K + tl.arange(0, BLOCK_K)
    if USE_DOT:  # [BLOCK_K, BLOCK_E] tiles of W^T; every product exact in FP64, sums rounded in FP64
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float64)
        for it in range(K_ITERS):
            xt = tl.load(x_rows + k[None, :], mask=t_ok & (k[None, :] < K), other=0.0).to(tl.float64)
            wt = tl.load(w_ptr + e[None, :] * stride_we + k[:, None], mask=(e[None, :] < E) & (k[:, None] < K),
                         other=0.0).to(tl.float64)
            acc = tl.dot(xt, wt, acc, input_precision="ieee", out_dtype=tl.float64)
            k += BLOCK_K
    else:
        # [BLOCK_E, BLOCK_K] tiles of W; one FP64 FMA per product into a [BLOCK_T, BLOCK_E, BLOCK_K]
        # accumulator, summed over K once after the loop (a tl.sum over K inside the loop would spread K
        # over lanes and cost FP64 shuffles on every tile).
        # The next tiles are loaded before this tile's FMAs, so their latency overlaps the arithmetic; the
        # last prefetch reads the next split's first tile (or masks past K) and is not used.
        acc3 = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_K], dtype=tl.float64)
        xt = tl.load(x_rows + k[None, :], mask=t_ok & (k[None, :] < K), other=0.0)
        wt = tl.load(w_ptr + e[:, None] * stride_we + k[None, :], mask=(e[:, None] < E) & (k[None, :] < K), other=0.0)
        for it in range(K_ITERS):
            k += BLOCK_K
            x_next = tl.load(x_rows + k[None, :], mask=t_ok & (k[None, :] < K), other=0.0)
            w_next = tl.load(w_ptr + e[:, None] * stride_we + k[None, :], mask=(e[:, None] < E) & (k[None, :] < K),
                             other=0.0)
            acc3 += xt.to(tl.float64)[:, None, :] * wt.to(tl.float64)[None, :, :]
            xt, wt = x_next, w_next
        acc = tl.sum(acc3, axis=2)
    out = part_ptr + (pk * T + t[:, None]).to(tl.int64) * E + e[None, :]
    tl.store(out, acc, mask=(t[:, None] < T) & (e[None, :] < E))


@triton.jit
def _router_topk_kernel(part_ptr, bias_ptr, ids_in_ptr, w_out_ptr, ids_out_ptr, logits_out_ptr, T, SPLIT, scaling,
                        E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr,
                        TOPK_P: tl.constexpr, RENORM: tl.constexpr, REPLAY: tl.constexpr, SBW: tl.constexpr,
                        LOGITS_OUT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E)
    # FP64 partials (or FP32 logits, SPLIT = 1) summed in FP64, rounded once to FP32
    acc = tl.load(part_ptr + t * E + e).to(tl.float64)
    for s in range(1, SPLIT):
        acc += tl.load(part_ptr + (s * T + t) * E + e).to(tl.float64)
    logits = acc.to(tl.float32)
    if LOGITS_OUT:
        tl.store(logits_out_ptr + t * E + e, logits)
    scores = libdevice.div_rn(1.0, 1.0 + libdevice.exp(-logits))  # ATen's sigmoid
    kk = tl.arange(0, TOPK_P)
    if REPLAY:
        ids = tl.load(ids_in_ptr + t * TOPK + kk, mask=kk < TOPK, other=-1).to(tl.int32)
        w = tl.sum(tl.where(e[None, :] == ids[:, None], scores[None, :], 0.0), axis=1)
    else:
        GS: tl.constexpr = E // NG
        biased = scores + tl.load(bias_ptr + e).to(tl.float32)
        b2 = tl.reshape(biased, [NG, GS])
        col = tl.arange(0, GS)[None, :]
        top1 = tl.argmax(b2, axis=1, tie_break_left=True)
        m1 = tl.max(b2, axis=1)
        m2 = tl.max(tl.where(col == top1[:, None], float("-inf"), b2), axis=1)
        group_scores = m1 + m2
        g = tl.arange(0, NG)
        kept = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(group_scores, axis=0, tie_break_left=True)
            kept = kept | (g == best)
            group_scores = tl.where(g == best, float("-inf"), group_scores)
        masked = tl.reshape(tl.where(kept[:, None], b2, float("-inf")), [E])
        ids = tl.zeros([TOPK_P], dtype=tl.int32)
        w = tl.zeros([TOPK_P], dtype=tl.float32)
        for i in tl.static_range(TOPK):
            best = tl.argmax(masked, axis=0, tie_break_left=True)
            ids = tl.where(kk == i, best, ids)
            w = tl.where(kk == i, tl.sum(tl.where(e == best, scores, 0.0), axis=0), w)
            masked = tl.where(e == best, float("-inf"), masked)
    if RENORM:
        # w.sum(-1) over [T, top_k] in ATen's order: element k sits at lane k % SBW, accumulator k // SBW.
        lane = tl.arange(0, SBW)[:, None, None]
        acc_j = tl.arange(0, 4)[None, :, None]
        tile = tl.sum(tl.where(lane + SBW * acc_j == kk[None, None, :], w[None, None, :], 0.0), axis=2)
        total = tl.sum(_block_x_tree(_combine4(tl.reshape(tile, [1, SBW, 4]), 1, SBW), 1, SBW), axis=0)
        w = libdevice.div_rn(w, total)
    w = w * scaling
    tl.store(w_out_ptr + t * TOPK + kk, w, mask=kk < TOPK)
    tl.store(ids_out_ptr + t * TOPK + kk, ids.to(ids_out_ptr.dtype.element_ty), mask=kk < TOPK)


TOPK_WARPS = 4  # the top-k program's warps unless a RouterLaunch says otherwise


class RouterLaunch(NamedTuple):
    """The GEMM's tile and warps and the top-k program's warps, overriding the defaults
    (`bench_kernels.py --tune` sweeps them). The top-k program keeps 4 warps, which `--tune` finds faster
    than one on the H200."""

    block_t: int
    block_e: int
    block_k: int
    num_warps: int = 4
    topk_warps: int = TOPK_WARPS


def _gemm_config(tokens: int, hidden: int, experts: int, split_k: int | None, use_dot: bool,
                 launch: RouterLaunch | None = None):
    """(block_t, block_e, block_k, num_warps, t_blocks, k_iters, split)."""
    num_warps = 4
    if launch is not None:
        block_t, block_e, block_k, num_warps = launch[:4]
        assert experts % block_e == 0, f"launch: block_e={block_e} must divide the {experts} experts"
    elif use_dot:  # 16-64 token rows (MMA tiles), 32-wide FP64 K tiles
        block_e = min(64, experts)
        block_t, block_k = max(16, min(64, triton.next_power_of_2(tokens))), 32
    else:  # no padding to 16 rows; <= 8192 FP64 accumulators per program (64 a thread at 4 warps). Chosen with
        # bench_kernels --tune on the H200 (5120 x 256): 32-expert blocks at 1-64 tokens, one warp at 1 token.
        block_e = min(32, experts)
        block_t = min(16, triton.next_power_of_2(tokens))
        block_k = 32 if block_t <= 4 else 16
        num_warps = 1 if block_t == 1 else 4
    t_blocks = triton.cdiv(tokens, block_t)
    k_blocks = triton.cdiv(hidden, block_k)
    if split_k is None:  # aim at ~2 programs per SM; no split once the token blocks fill the GPU
        split_k = max(1, min(k_blocks, 264 // max(1, (experts // block_e) * t_blocks)))
    k_iters = triton.cdiv(k_blocks, split_k)
    split = triton.cdiv(k_blocks, k_iters)
    return block_t, block_e, block_k, num_warps, t_blocks, k_iters, split


def _check_router_args(x, weight, num_experts, n_group, top_k, topk_group):
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, hidden] with a contiguous hidden dim"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), "x must be BF16/FP16/FP32 (exact FP64 products)"
    assert weight.dtype == torch.float32 and weight.is_contiguous() and weight.shape[1] == x.shape[1]
    assert num_experts & (num_experts - 1) == 0 and num_experts >= 16, "experts must be a power of two >= 16"
    if n_group is not None:
        assert num_experts % n_group == 0 and n_group & (n_group - 1) == 0, "groups must be a power of two"
        assert topk_group <= n_group and top_k <= topk_group * (num_experts // n_group)


def _launch_gemm(x, weight, split_k, use_dot, launch=None):
    tokens, hidden = x.shape
    experts = weight.shape[0]
    block_t, block_e, block_k, num_warps, t_blocks, k_iters, split = _gemm_config(
        tokens, hidden, experts, split_k, use_dot, launch)
    part = torch.empty((split, tokens, experts), dtype=torch.float64, device=x.device)
    _router_gemm_kernel[(experts // block_e, split, t_blocks)](
        x, weight, part, tokens, hidden, experts, x.stride(0), weight.stride(0), k_iters,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, USE_DOT=use_dot, num_warps=num_warps, **LAUNCH_OPTS)
    return part, split


def _logit_partials(x, weight, split_k=None, use_dot=None, launch=None):
    """FP64 logit partials [split, T, E] (their FP64 sum rounded to FP32 is the logits) and split."""
    global _FP64_DOT
    if use_dot is not None:
        return _launch_gemm(x, weight, split_k, use_dot, launch)
    if _FP64_DOT is None:  # first call: does this Triton/GPU compile an FP64 tl.dot?
        try:
            out = _launch_gemm(x, weight, split_k, True, launch)
            _FP64_DOT = True
            return out
        except Exception as err:  # noqa: BLE001 - any compile failure; the fallback re-raises real errors
            warnings.warn(f"router: FP64 tl.dot did not compile ({type(err).__name__}: {err}); using the "
                          "broadcast-multiply FP64 GEMM (same logits)", stacklevel=2)
            _FP64_DOT = False
    return _launch_gemm(x, weight, split_k, _FP64_DOT, launch)


def _logits_or_partials(x, weight, split_k, launch=None):
    if x.shape[0] > TRITON_GEMM_MAX_TOKENS:  # prefill: the reference's own FP64 GEMM (cuBLAS DGEMM)
        return routing.router_logits(x, weight).contiguous(), 1
    return _logit_partials(x, weight, split_k, launch=launch)


def _topk(part, split, tokens, experts, bias, ids_in, top_k, n_group, topk_group, scaling, norm_topk_prob, ids_dtype,
          out=None, logits_out=None, num_warps=TOPK_WARPS):
    if out is None:
        weights = torch.empty((tokens, top_k), dtype=torch.float32, device=part.device)
        ids = torch.empty((tokens, top_k), dtype=ids_dtype, device=part.device)
    else:
        weights, ids = out
        assert weights.shape == (tokens, top_k) and weights.dtype == torch.float32 and weights.is_contiguous()
        assert ids.shape == (tokens, top_k) and ids.is_contiguous()
    if logits_out is not None:
        assert logits_out.shape == (tokens, experts) and logits_out.dtype == torch.float32
        assert logits_out.is_contiguous()
    _, sbw, iters = cuda_sum_config(top_k, tokens)
    assert iters == 1
    replay = ids_in is not None
    _router_topk_kernel[(tokens,)](
        part, bias if bias is not None else part, ids_in if replay else ids, weights, ids,
        logits_out if logits_out is not None else weights, tokens, split, scaling,
        E=experts, NG=n_group or 1, TOPK_GROUP=topk_group or 1, TOPK=top_k, TOPK_P=triton.next_power_of_2(top_k),
        RENORM=norm_topk_prob, REPLAY=replay, SBW=sbw, LOGITS_OUT=logits_out is not None, num_warps=num_warps,
        **LAUNCH_OPTS)
    return weights, (ids_in.long() if replay else ids)


def route_triton(x, weight, correction_bias, *, top_k, n_group, topk_group, routed_scaling_factor,
                 norm_topk_prob=True, split_k=None, ids_dtype=torch.int64, out=None, logits_out=None, launch=None):
    """FP64-accumulated router GEMM + grouped sigmoid top-k: (FP32 weights [T, top_k], ids [T, top_k]).

    `logits_out` (FP32 [T, E], optional) receives the logits the epilogue used; `launch` (a RouterLaunch)
    overrides the kernels' tile and warps."""
    experts = weight.shape[0]
    _check_router_args(x, weight, experts, n_group, top_k, topk_group)
    assert correction_bias.shape == (experts,) and correction_bias.is_contiguous()
    tokens = x.shape[0]
    if tokens == 0:
        return (torch.empty((0, top_k), dtype=torch.float32, device=x.device),
                torch.empty((0, top_k), dtype=ids_dtype, device=x.device))
    part, split = _logits_or_partials(x, weight, split_k, launch)
    return _topk(part, split, tokens, experts, correction_bias, None, top_k, n_group, topk_group,
                 routed_scaling_factor, norm_topk_prob, ids_dtype, out, logits_out,
                 num_warps=launch.topk_warps if launch is not None else TOPK_WARPS)


def replay_triton(x, weight, ids, *, routed_scaling_factor, norm_topk_prob=True, split_k=None, logits_out=None):
    """R3 replay: FP64-accumulated router GEMM, then the gate weights of the given ids [T, K] from its scores."""
    experts = weight.shape[0]
    _check_router_args(x, weight, experts, None, ids.shape[1], None)
    assert ids.dim() == 2 and ids.shape[0] == x.shape[0], f"ids must be [T, top_k]; got {tuple(ids.shape)}"
    ids = ids.contiguous()
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.empty((0, top_k), dtype=torch.float32, device=x.device), ids
    part, split = _logits_or_partials(x, weight, split_k)
    return _topk(part, split, tokens, experts, None, ids, top_k, None, None, routed_scaling_factor,
                 norm_topk_prob, ids.dtype, None, logits_out)


def select_experts_triton(logits, correction_bias, *, top_k, n_group, topk_group, routed_scaling_factor,
                          norm_topk_prob=True, ids_dtype=torch.int64, out=None):
    """The top-k epilogue alone on given FP32 logits [T, E]: bit-exact to `routing.select_experts`."""
    tokens, experts = logits.shape
    assert logits.dtype == torch.float32 and logits.is_contiguous()
    if tokens == 0:
        return (torch.empty((0, top_k), dtype=torch.float32, device=logits.device),
                torch.empty((0, top_k), dtype=ids_dtype, device=logits.device))
    return _topk(logits, 1, tokens, experts, correction_bias, None, top_k, n_group, topk_group,
                 routed_scaling_factor, norm_topk_prob, ids_dtype, out)


def replay_experts_triton(logits, ids, *, routed_scaling_factor, norm_topk_prob=True):
    """Replay epilogue alone on given FP32 logits: bit-exact to `routing.replay_experts` (ids unchecked)."""
    tokens, experts = logits.shape
    assert logits.dtype == torch.float32 and logits.is_contiguous() and ids.shape[0] == tokens
    if tokens == 0:
        return torch.empty((0, ids.shape[1]), dtype=torch.float32, device=logits.device), ids
    return _topk(logits, 1, tokens, experts, None, ids.contiguous(), ids.shape[1], None, None,
                 routed_scaling_factor, norm_topk_prob, ids.dtype)


def route(x, weight, correction_bias, *, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob=True,
          ids_dtype=torch.int64):
    """Dispatch: Triton on CUDA, `routing.router_logits` + `routing.select_experts` elsewhere. The kernel
    writes ids in `ids_dtype` itself (vLLM's fused MoE takes int32: no conversion kernel per layer)."""
    if use_triton(x, weight):
        return route_triton(x, weight, correction_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                            routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob,
                            ids_dtype=ids_dtype)
    weights, ids = routing.select_experts(routing.router_logits(x, weight), correction_bias, top_k=top_k,
                                          n_group=n_group, topk_group=topk_group,
                                          routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob)
    return weights, ids.to(ids_dtype)


def replay(x, weight, ids, *, routed_scaling_factor, norm_topk_prob=True):
    """Dispatch: Triton on CUDA, `routing.router_logits` + `routing.replay_experts` elsewhere."""
    if use_triton(x, weight):
        return replay_triton(x, weight, ids, routed_scaling_factor=routed_scaling_factor,
                             norm_topk_prob=norm_topk_prob)
    return routing.replay_experts(routing.router_logits(x, weight), ids, routed_scaling_factor=routed_scaling_factor,
                                  norm_topk_prob=norm_topk_prob)

