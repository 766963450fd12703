"""Beam attention for vLLM: QKV + gate projections, Q/K norm with RoPE or SSMax, paged attention
with a per-layer sliding window, sigmoid output gate, output projection.

Numerics: q/k norm, RoPE/SSMax and the output gate follow `beam_rl.model.numerics` exactly (through
the fused kernels on CUDA); the attention itself is vLLM's backend (FP32-accumulating flash
attention), a documented difference from the FP64 reference. Serving an MXFP8 trainer, the
projections' inputs are quantised as its linears quantise them (`beam_rl.rollout.linear`).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

from beam_rl.model.config import BeamConfig
from beam_rl.rollout import ops
from beam_rl.rollout.linear import linear_precision, lora_enabled, mxfp8_inputs, reduce_in_fp32, round_like


class BeamAttention(nn.Module):
    def __init__(self, config: BeamConfig, layer_idx: int, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        if config.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads={config.num_attention_heads} is not divisible by tensor_parallel_size={tp}")
        if config.num_key_value_heads % tp and tp % config.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={config.num_key_value_heads} and tensor_parallel_size={tp}: one must divide the other")
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.eps = config.rms_norm_eps
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.mxfp8 = linear_precision(config) == "mxfp8"

        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=False, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        self.gate_proj = ColumnParallelLinear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.gate_proj",
        )
        # One bias per head; each TP rank keeps its own heads' slice.
        self.gate_bias = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.gate_bias.weight_loader = self._load_gate_bias
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )
        reduce_in_fp32(self.o_proj, lora_enabled=lora_enabled())
        self.q_norm = ops.NormWeight(self.head_dim)  # one weight shared by all heads
        self.k_norm = ops.NormWeight(self.head_dim)
        self.positional = ops.rope_tables(config) if self.is_sliding else ops.ssmax_table(config)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
            cache_config=cache_config, quant_config=quant_config,
            per_layer_sliding_window=config.sliding_window if self.is_sliding else None,
            prefix=f"{prefix}.attn",
        )

    def _load_gate_bias(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rank = get_tensor_model_parallel_rank()
        param.data.copy_(loaded[rank * self.num_heads : (rank + 1) * self.num_heads])

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x_in = mxfp8_inputs(x, self.mxfp8)
        qkv, _ = self.qkv_proj(x_in)
        gate, _ = self.gate_proj(x_in)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        T = x.shape[0]
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = ops.qk_norm_positional(
            q, k, self.q_norm.weight, self.k_norm.weight, positions, self.eps, self.is_sliding, self.positional
        )
        attn = self.attn(q.reshape(T, self.q_size), k.reshape(T, self.kv_size), v)  # a view: vLLM reads its strides
        gated = ops.output_gate(
            attn.view(T, self.num_heads, self.head_dim), gate.view(T, self.num_heads, self.head_dim), self.gate_bias
        )
        out, _ = self.o_proj(mxfp8_inputs(gated.reshape(T, self.q_size), self.mxfp8))
        return round_like(out, x)
