"""FP32 MoE router: split-K FP32 GEMM for small token counts + grouped sigmoid top-k, and its replay.

Two launches: (1) logits partials [split, T, E] = x[:, k-slice] @ W[:, k-slice]^T with FP32 FMA
(`input_precision="ieee"`: no TF32), spread over E-blocks x K-slices so a 1-64 token call fills the
GPU; (2) one program per token sums the partials in split order and runs `routing.select_experts`
(or `replay_experts`) with its exact arithmetic: ATen's sigmoid, biased group top-2 sums, top
`topk_group` groups, top `top_k` experts (ties to the lower id), renormalised in ATen's sum order,
times the scaling factor. Given the same logits the epilogue is bit-exact; the GEMM's FP32 sum order
differs from cuBLAS, so weights differ by reduction-order rounding only (see docs/benchmarks.md).
"""

import torch

from beam_rl import routing

from ._triton_compat import LAUNCH_OPTS, libdevice, tl, triton, use_triton
from .reduce_order import _block_x_tree, _combine4, cuda_sum_config

# Up to this many tokens the split-K Triton GEMM runs; above it cuBLAS computes the logits (then the
# epilogue is bit-exact to the reference end to end).
TRITON_GEMM_MAX_TOKENS = 256


@triton.jit
def _router_gemm_kernel(x_ptr, w_ptr, part_ptr, T, K, E, stride_xt, stride_we, K_ITERS,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    pe = tl.program_id(0)
    pk = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for it in range(K_ITERS):
        k = (pk * K_ITERS + it) * BLOCK_K + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + k[None, :],
                     mask=(t[:, None] < T) & (k[None, :] < K), other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + e[None, :] * stride_we + k[:, None], mask=(e[None, :] < E) & (k[:, None] < K), other=0.0)
        acc = tl.dot(xt, wt, acc, input_precision="ieee")
    out = part_ptr + (pk * T + t[:, None]).to(tl.int64) * E + e[None, :]
    tl.store(out, acc, mask=(t[:, None] < T) & (e[None, :] < E))


@triton.jit
def _router_topk_kernel(part_ptr, bias_ptr, ids_in_ptr, w_out_ptr, ids_out_ptr, T, SPLIT, scaling,
                        E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr,
                        TOPK_P: tl.constexpr, RENORM: tl.constexpr, REPLAY: tl.constexpr, SBW: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E)
    logits = tl.load(part_ptr + t * E + e)
    for s in range(1, SPLIT):
        logits += tl.load(part_ptr + (s * T + t) * E + e)
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


def _gemm_config(tokens: int, hidden: int, experts: int, split_k: int | None):
    block_t = max(16, min(64, triton.next_power_of_2(tokens)))
    block_e = min(64, experts)
    block_k = 64
    t_blocks = triton.cdiv(tokens, block_t)
    k_blocks = triton.cdiv(hidden, block_k)
    if split_k is None:  # aim at ~2 programs per SM; no split once the token blocks fill the GPU
        split_k = max(1, min(k_blocks, 264 // max(1, (experts // block_e) * t_blocks)))
    k_iters = triton.cdiv(k_blocks, split_k)
    split = triton.cdiv(k_blocks, k_iters)
    return block_t, block_e, block_k, t_blocks, k_iters, split


def _check_router_args(x, weight, num_experts, n_group, top_k, topk_group):
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, hidden] with a contiguous hidden dim"
    assert weight.dtype == torch.float32 and weight.is_contiguous() and weight.shape[1] == x.shape[1]
    assert num_experts & (num_experts - 1) == 0 and num_experts >= 16, "experts must be a power of two >= 16"
    if n_group is not None:
        assert num_experts % n_group == 0 and n_group & (n_group - 1) == 0, "groups must be a power of two"
        assert topk_group <= n_group and top_k <= topk_group * (num_experts // n_group)


def _logit_partials(x, weight, split_k):
    tokens, hidden = x.shape
    experts = weight.shape[0]
    block_t, block_e, block_k, t_blocks, k_iters, split = _gemm_config(tokens, hidden, experts, split_k)
    part = torch.empty((split, tokens, experts), dtype=torch.float32, device=x.device)
    _router_gemm_kernel[(experts // block_e, split, t_blocks)](
        x, weight, part, tokens, hidden, experts, x.stride(0), weight.stride(0), k_iters,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4, **LAUNCH_OPTS)
    return part, split


def _topk(part, split, tokens, experts, bias, ids_in, top_k, n_group, topk_group, scaling, norm_topk_prob, ids_dtype,
          out=None):
    if out is None:
        weights = torch.empty((tokens, top_k), dtype=torch.float32, device=part.device)
        ids = torch.empty((tokens, top_k), dtype=ids_dtype, device=part.device)
    else:
        weights, ids = out
        assert weights.shape == (tokens, top_k) and weights.dtype == torch.float32 and weights.is_contiguous()
        assert ids.shape == (tokens, top_k) and ids.is_contiguous()
    _, sbw, iters = cuda_sum_config(top_k, tokens)
    assert iters == 1
    replay = ids_in is not None
    _router_topk_kernel[(tokens,)](
        part, bias if bias is not None else part, ids_in if replay else ids, weights, ids, tokens, split, scaling,
        E=experts, NG=n_group or 1, TOPK_GROUP=topk_group or 1, TOPK=top_k, TOPK_P=triton.next_power_of_2(top_k),
        RENORM=norm_topk_prob, REPLAY=replay, SBW=sbw, num_warps=4, **LAUNCH_OPTS)
    return weights, (ids_in.long() if replay else ids)


def route_triton(x, weight, correction_bias, *, top_k, n_group, topk_group, routed_scaling_factor,
                 norm_topk_prob=True, split_k=None, ids_dtype=torch.int64, out=None):
    """FP32 router GEMM + grouped sigmoid top-k: (FP32 weights [T, top_k], ids [T, top_k]); exact epilogue."""
    experts = weight.shape[0]
    _check_router_args(x, weight, experts, n_group, top_k, topk_group)
    assert correction_bias.shape == (experts,) and correction_bias.is_contiguous()
    tokens = x.shape[0]
    if tokens == 0:
        return (torch.empty((0, top_k), dtype=torch.float32, device=x.device),
                torch.empty((0, top_k), dtype=ids_dtype, device=x.device))
    if tokens > TRITON_GEMM_MAX_TOKENS:  # a big batch fills the GPU without split-K: cuBLAS's FP32 GEMM is the faster one
        part, split = routing.router_logits(x, weight).contiguous(), 1
    else:
        part, split = _logit_partials(x, weight, split_k)
    return _topk(part, split, tokens, experts, correction_bias, None, top_k, n_group, topk_group,
                 routed_scaling_factor, norm_topk_prob, ids_dtype, out)


def replay_triton(x, weight, ids, *, routed_scaling_factor, norm_topk_prob=True, split_k=None):
    """R3 replay: FP32 router GEMM, then the gate weights of the given ids [T, K] from this router's scores."""
    experts = weight.shape[0]
    _check_router_args(x, weight, experts, None, ids.shape[1], None)
    assert ids.dim() == 2 and ids.shape[0] == x.shape[0], f"ids must be [T, top_k]; got {tuple(ids.shape)}"
    ids = ids.contiguous()
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.empty((0, top_k), dtype=torch.float32, device=x.device), ids
    if tokens > TRITON_GEMM_MAX_TOKENS:
        part, split = routing.router_logits(x, weight).contiguous(), 1
    else:
        part, split = _logit_partials(x, weight, split_k)
    return _topk(part, split, tokens, experts, None, ids, top_k, None, None, routed_scaling_factor,
                 norm_topk_prob, ids.dtype)


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


def route(x, weight, correction_bias, *, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob=True):
    """Dispatch: Triton on CUDA, `routing.router_logits` + `routing.select_experts` elsewhere."""
    if use_triton(x, weight):
        return route_triton(x, weight, correction_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                            routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob)
    return routing.select_experts(routing.router_logits(x, weight), correction_bias, top_k=top_k, n_group=n_group,
                                  topk_group=topk_group, routed_scaling_factor=routed_scaling_factor,
                                  norm_topk_prob=norm_topk_prob)


def replay(x, weight, ids, *, routed_scaling_factor, norm_topk_prob=True):
    """Dispatch: Triton on CUDA, `routing.router_logits` + `routing.replay_experts` elsewhere."""
    if use_triton(x, weight):
        return replay_triton(x, weight, ids, routed_scaling_factor=routed_scaling_factor,
                             norm_topk_prob=norm_topk_prob)
    return routing.replay_experts(routing.router_logits(x, weight), ids, routed_scaling_factor=routed_scaling_factor,
                                  norm_topk_prob=norm_topk_prob)

