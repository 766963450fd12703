"""`BeamWorkerExtension`: beam-rl's methods inside vLLM workers, reached with `collective_rpc`.

Start the engine with `worker_extension_cls="beam_rl.rollout.worker.BeamWorkerExtension"`.

- Routed-expert capture on every runner (`beam_rl.rollout.capture`): `beam_start_routing_capture`
  wraps the model runner's `execute_model`; after each step the rows the model's `RoutingRecorder`
  wrote are queued for the host without waiting for the GPU; `beam_pop_routed_experts` returns, per
  finished request, the same array vLLM puts in `CompletionOutput.routed_experts`.
- Weights: `beam_reload_weights` reloads a checkpoint in place and returns the checksum of every
  tensor as received (HF names), so the sender can verify the sync tensor by tensor;
  `beam_begin_weight_update` / `beam_end_weight_update` record the same around an update through
  vLLM's weight-transfer API (NCCL, `beam_gloo`), plus which parameters nothing reached;
  `beam_parameter_checksums` fingerprints the loaded model itself (reload == fresh load);
  `beam_expert_layout` says which experts this rank holds (CPU experts, expert parallelism).
- Sampling: `beam_counter_seeded_sampling` puts `beam_rl.rollout.sampling`'s counter-seeded
  `random_sample` (one launch for every seeded row of a step) in place of vLLM's, or takes it out.
- `beam_attention_isas`: which kernels vLLM's CPU attention uses in this worker (they decide how P
  is rounded); `beam_cpu_bf16_rounding`: how this worker's vLLM CPU kernel library converts FP32 to
  BF16 (it decides how the attention output is rounded). `engine_attention_numerics(llm)` asks
  every worker and returns the definition a trainer must compute (`numerics.AttentionNumerics`).
"""

from __future__ import annotations

import numpy as np
import torch

from beam_rl.model.numerics import AttentionNumerics, round_to
from beam_rl.rollout.capture import RequestRouting
from beam_rl.rollout.compat import tensor_names


# vLLM's CPU attention kernel sets ("isa", chosen per engine by `_get_attn_isa`) that round the
# probabilities P to BF16 before P.V (`beam_rl.model.numerics.attention` probs="bf16")
BF16_PROBS_CPU_ATTENTION_ISAS = ("amx",)


def attention_probs_of_isa(isa: str | None) -> str:
    """How attention kernels `isa` round the probabilities (`numerics.attention` probs=): "bf16"
    for `BF16_PROBS_CPU_ATTENTION_ISAS`, "exact" for the other CPU kernel sets (they keep P in
    FP32) and on CUDA (isa None), where FlashAttention rounds P per key tile against a running
    maximum, which a whole-row rounding does not reproduce, so trainers keep FP32 there."""
    return "bf16" if isa in BF16_PROBS_CPU_ATTENTION_ISAS else "exact"


def engine_attention_numerics(llm) -> AttentionNumerics:
    """How the running engine's attention rounds: P as `attention_probs_of_isa` of its kernels,
    the output as its CPU kernel library converts FP32 to BF16 (`cpu_kernel_bf16_rounding`; round
    to nearest on CUDA). Asked of the engine, not predicted for this machine: its workers choose
    for themselves, and a worker has been seen to pick "vec" on a machine whose own process
    reports AMX."""
    isa = engine_attention_isa(llm)
    if isa is None:
        return AttentionNumerics()
    roundings = set(llm.collective_rpc("beam_cpu_bf16_rounding"))
    if len(roundings) > 1:
        raise RuntimeError(f"vLLM's CPU kernels round FP32 to BF16 differently across workers: {sorted(roundings)}")
    return AttentionNumerics(probs=attention_probs_of_isa(isa), output_rounding=roundings.pop())


def cpu_kernel_bf16_rounding() -> str:
    """How the vLLM CPU kernel library loaded in this process converts FP32 to BF16: "nearest"
    (`_mm512_cvtneps_pbh`, builds for AVX512-BF16 CPUs) or "toward_zero" (the AVX2 and plain
    AVX512 builds drop the low 16 bits). Measured on the library's RMSNorm, which stores its FP32
    result through the same vector conversion as its attention kernels."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(256, generator=g)).to(torch.bfloat16)
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, 1e-6)
    xd = x.double()
    exact = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()).float()
    agreement = {r: (out == round_to(exact, torch.bfloat16, r)).float().mean().item() for r in ("nearest", "toward_zero")}
    best = max(agreement, key=agreement.get)
    if agreement[best] < 0.99:  # the two differ on ~half the elements; anything else is an unknown conversion
        raise RuntimeError(f"vLLM's CPU kernels convert FP32 to BF16 neither to nearest nor toward zero: agreement {agreement}")
    return best


def engine_attention_isa(llm) -> str | None:
    """The kernel set ("amx", "vec", ...) vLLM's CPU attention uses in every worker of llm (started with
    this extension), None where attention is not vLLM's CPU backend (CUDA); an error if workers or
    layers disagree (a trainer can define attention one way only)."""
    isas = {isa for worker in llm.collective_rpc("beam_attention_isas") for isa in worker}
    if len(isas) > 1:
        raise RuntimeError(f"vLLM's CPU attention uses different kernel sets across layers or workers: {sorted(isas)}")
    return isas.pop() if isas else None


def scheduled_token_counts(runner, scheduler_output, req_ids: list[str]) -> np.ndarray:
    """Tokens this step fed per request of the batch, in its order: the differences of the model
    runner's query_start_loc, which the step's input preparation just filled (no Python per request);
    from the scheduler's dict where a runner keeps no such host array."""
    start = getattr(getattr(runner, "query_start_loc", None), "np", None)
    if start is not None and len(start) > len(req_ids):
        counts = np.diff(start[: len(req_ids) + 1])
        if int(counts.sum()) == scheduler_output.total_num_scheduled_tokens:
            return counts
    return np.array([scheduler_output.num_scheduled_tokens.get(r, 0) for r in req_ids], dtype=np.int64)


class BeamWorkerExtension:
    def _beam_model(self):
        return self.model_runner.get_model() if hasattr(self.model_runner, "get_model") else self.model_runner.model

    # -- routed experts -------------------------------------------------------------------------
    def beam_start_routing_capture(self) -> bool:
        model = self._beam_model()
        recorder = getattr(model, "routing_recorder", None)
        if recorder is None:
            raise RuntimeError("the loaded model has no routing recorder; is it beam_rl.rollout's BeamForCausalLM?")
        if getattr(self, "_beam_routing", None) is None:
            self._beam_routing = RequestRouting(recorder)
        runner = self.model_runner
        if "execute_model" in vars(runner):
            return True  # already filing
        original = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            out = original(scheduler_output, *args, **kwargs)
            req_ids = runner.input_batch.req_ids
            positions = getattr(runner.positions, "gpu", runner.positions)
            self._beam_routing.file_step(req_ids, scheduled_token_counts(runner, scheduler_output, req_ids), positions)
            return out

        runner.execute_model = execute_model
        return True

    # -- sampling ---------------------------------------------------------------------------------
    def beam_counter_seeded_sampling(self, on: bool) -> bool:
        """Install (on) or remove `beam_rl.rollout.sampling`'s counter-seeded `random_sample` in this
        worker's process; True while installed."""
        from beam_rl.rollout import sampling

        sampling.install() if on else sampling.uninstall()
        return sampling.installed()

    # -- adaptive verification of DFlash2 drafts ---------------------------------------------------
    def beam_start_adaptive_verification(self, step_costs: tuple[float, float, float] | None = None) -> bool:
        """From the next step on, verify per request only the draft tokens worth their cost
        (`beam_rl.rollout.adaptive.AdaptiveVerifier`): the drafts leave the runner truncated
        (`take_draft_token_ids`, synchronous scheduling), and each verification's accepted counts and
        step time feed the estimator and the cost fit (`propose_draft_token_ids`, which runs after
        the rejection sampler). `step_costs`: (a, b, c) ms of a step, a + b * tokens + c * requests,
        instead of fitting them on the engine's steps."""
        import time

        from beam_rl.rollout.adaptive import AdaptiveVerifier, StepCosts
        from beam_rl.rollout.dflash2 import DFlash2BeamDraftModel

        runner = self.model_runner
        drafter = getattr(getattr(runner, "drafter", None), "model", None)
        drafter = drafter.unwrap() if hasattr(drafter, "unwrap") else drafter
        if not isinstance(drafter, DFlash2BeamDraftModel):
            raise RuntimeError("adaptive verification needs beam-rl's DFlash2 drafter (speculative_config method 'dflash', "
                               f"a DFlash2BeamDraftModel directory); this engine's drafter is {type(drafter).__name__}")
        if getattr(runner, "use_async_scheduling", False):
            raise RuntimeError("adaptive verification truncates drafts on the host: start the engine with async_scheduling=False")
        costs = StepCosts(fixed=tuple(step_costs) if step_costs is not None else None)
        if "take_draft_token_ids" in vars(runner):  # already verifying adaptively: new costs only
            self._beam_verifier.costs = costs
            return True
        verifier = self._beam_verifier = AdaptiveVerifier(drafter.model.block - 1, costs=costs,
                                                          max_tokens=runner.scheduler_config.max_num_batched_tokens)
        take, propose = runner.take_draft_token_ids, runner.propose_draft_token_ids
        step = {"clock": None, "accepted": None, "tokens": 0}

        def propose_draft_token_ids(scheduler_output, sampled_token_ids, *args, **kwargs):
            verified = scheduler_output.scheduled_spec_decode_tokens
            if verified:  # the rejection sampler's output: each row's kept tokens, -1 past them
                rows = sampled_token_ids.tolist() if hasattr(sampled_token_ids, "tolist") else sampled_token_ids
                index = {r: i for i, r in enumerate(runner.input_batch.req_ids)}
                step["accepted"] = {r: sum(t >= 0 for t in rows[index[r]]) - 1 for r in verified if r in index}
                step["tokens"] = scheduler_output.total_num_scheduled_tokens
            return propose(scheduler_output, sampled_token_ids, *args, **kwargs)

        def take_draft_token_ids():
            out = take()
            now = time.perf_counter()  # take -> take: one whole step (schedule, verify, sample, draft)
            if step["accepted"] is not None:
                ms = None if step["clock"] is None else (now - step["clock"]) * 1e3
                verifier.observe(step["accepted"], ms, step["tokens"])
                step["accepted"] = None
            step["clock"] = now
            f = drafter.last_confidence
            if out is None or f is None or f.shape[0] != len(out.req_ids):
                return out
            counts = verifier.plan(list(out.req_ids), f.cpu())
            return type(out)(out.req_ids, [list(ids)[:n] for ids, n in zip(out.draft_token_ids, counts)])

        drafter.track_confidence = True
        runner.take_draft_token_ids, runner.propose_draft_token_ids = take_draft_token_ids, propose_draft_token_ids
        return True

    def beam_adaptive_verification_stats(self) -> dict:
        """Draft tokens proposed and verified since the start, and the estimator's parameters."""
        v = self._beam_verifier
        return {"drafted": v.drafted, "verified": v.verified, "w": v.estimator.w, "b": v.estimator.b.tolist(),
                "costs": v.costs.fit()}

    def beam_stop_routing_capture(self) -> bool:
        """Stop filing steps (the model still records into its buffer; nothing reaches the host)."""
        vars(self.model_runner).pop("execute_model", None)
        return True

    def beam_routing_steps_filed(self) -> int:
        """Model steps filed since the capture started (those that scheduled tokens)."""
        routing = getattr(self, "_beam_routing", None)
        if routing is None:
            raise RuntimeError("call beam_start_routing_capture before generating")
        return routing.steps_filed

    def beam_pop_routed_experts(self, request_ids: list[str]) -> dict[str, tuple[tuple[int, ...], str, bytes]]:
        """Routing of the given (external) request ids, as (shape, dtype, bytes) so it crosses
        process boundaries intact; `beam_rl.rollout.routing.fetch_captured_routing` decodes it."""
        routing = getattr(self, "_beam_routing", None)
        if routing is None:
            raise RuntimeError("call beam_start_routing_capture before generating")
        wanted = set(request_ids)
        internal_of = {}
        for internal in routing.known():
            # vLLM may append a uniquifying suffix to the caller's request id.
            rid = internal if internal in wanted else internal.rsplit("-", 1)[0]
            if rid in wanted:
                internal_of[internal] = rid
        arrays = routing.pop_many(list(internal_of))
        return {internal_of[i]: (a.shape, a.dtype.str, a.tobytes()) for i, a in arrays.items()}

    # -- weights ----------------------------------------------------------------------------------
    def beam_reload_weights(self, weights_path: str) -> dict[str, str]:
        """Reload a checkpoint directory in place (vLLM's layerwise `reload_weights`); returns the
        `tensor_checksum` of every tensor as received, by HF name, for the sender to compare.
        Raises if the reload left any model parameter without a load (a checkpoint that lacks
        tensors, or a loader that skipped some)."""
        return self._beam_reload(weights_path, weights_path=weights_path)

    def beam_load_weights(self, tensors: list[tuple[str, torch.Tensor]], layerwise: bool = True) -> dict[str, str]:
        """`beam_reload_weights` from (HF name, tensor) pairs instead of files: for an engine whose
        core runs in the caller's process, where `collective_rpc` hands the tensors over by reference
        (the trainer's GPU tensors load straight into the model).

        `layerwise`: through vLLM's layerwise reload, which re-runs each layer's
        `process_weights_after_loading` (needed where that repacks weights: vLLM's CPU linear
        layers pre-pack for oneDNN). Else the model's `load_weights` copies into the loaded
        parameters directly, as RL frameworks update unquantized vLLM models: one weight-loader call
        per tensor instead of vLLM's per-load bookkeeping (~1 ms per tensor; beam-mini has ~2.4k)."""
        what = f"{len(tensors)} in-memory tensors"
        if layerwise:
            return self._beam_reload(what, weights_iterator=iter(tensors))
        return self._beam_reload(what, load=lambda: self._beam_model().load_weights(iter(tensors)))

    def _beam_reload(self, what: str, load=None, **source) -> dict[str, str]:
        self.beam_begin_weight_update()
        try:
            if load is not None:
                load()
            else:
                self.model_runner.reload_weights(is_checkpoint_format=True, **source)
        finally:
            report = self.beam_end_weight_update()
        if report["not_loaded"]:
            raise RuntimeError(f"reload of {what} loaded no data into {len(report['not_loaded'])} parameter(s), "
                               f"e.g. {report['not_loaded'][:3]}")
        return report["checksums"]

    def beam_begin_weight_update(self) -> bool:
        """Start recording what the model's `load_weights` receives: call before vLLM's
        `start_weight_update` (weight-transfer API) or a reload."""
        model = self._beam_model()
        model.received_checksums, model.loaded_names = {}, set()
        model.update_tensor_names = tensor_names(model)  # read once: a transfer loads tensor by tensor
        model.update_device = self.device  # files are read into host memory, fingerprinted on this device
        return True

    def beam_end_weight_update(self) -> dict:
        """Stop recording; returns {"checksums": HF name -> `tensor_checksum` as received,
        "not_loaded": model parameters no received tensor reached}."""
        model = self._beam_model()
        received, loaded = dict(model.received_checksums or {}), set(model.loaded_names or ())
        model.received_checksums = model.loaded_names = model.update_tensor_names = model.update_device = None
        params = {n for n, _ in model.named_parameters()}
        return {"checksums": received, "not_loaded": sorted(params - loaded)}

    def beam_weight_manifest(self) -> dict[str, list]:
        """{HF name: [shape, dtype]} of every checkpoint tensor this worker's model loads (the Beam
        tensor table of its config, in the storage dtypes of its model dtype): what a sync checks
        its payload against before pausing anything."""
        from beam_rl.model.weights import checkpoint_tensors

        mc = self.model_runner.model_config
        return {name: [list(spec.shape), str(spec.dtype(mc.dtype)).removeprefix("torch.")]
                for name, spec in checkpoint_tensors(mc.hf_config).items()}

    def beam_parameter_checksums(self) -> dict[str, str]:
        """`tensor_checksum` of every parameter and buffer of the loaded model as it is now (vLLM's
        names, kernel format): equal maps mean bit-identical models, e.g. after an in-place reload
        versus a fresh load of the same checkpoint."""
        from beam_rl.model.weights import tensor_checksum

        model = self._beam_model()
        return {name: tensor_checksum(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}

    def beam_attention_isas(self) -> list[str]:
        """The distinct kernel sets vLLM's CPU attention chose for this worker's attention layers (its
        metadata builder sets `isa` on each layer when the KV cache is set up); [] on other backends."""
        return sorted({m.isa for m in self._beam_model().modules() if isinstance(getattr(m, "isa", None), str)})

    def beam_cpu_bf16_rounding(self) -> str:
        """`cpu_kernel_bf16_rounding` of this (CPU) worker."""
        return cpu_kernel_bf16_rounding()

    def beam_additional_config(self) -> dict:
        """This worker's `vllm_config.additional_config` (vLLM hashes it into its torch.compile cache key;
        the model records `beam_rl_fused_kernels` there)."""
        return dict(self.vllm_config.additional_config)

    def beam_expert_layout(self) -> dict[int, tuple[int, int, int, int, str, str]]:
        """Per MoE layer of this rank's reference experts (CPU; MXFP8 serving): (ep_rank, ep_size, first expert, number of local
        experts, checksum of w13, checksum of w2), for checking expert-parallel placement and loading."""
        from beam_rl.rollout.moe import ReferenceExperts
        from beam_rl.model.weights import tensor_checksum

        return {int(name.split(".")[2]): (m.ep_rank, m.ep_size, m.first_expert, m.num_local_experts,
                                          tensor_checksum(m.w13_weight), tensor_checksum(m.w2_weight))
                for name, m in self._beam_model().named_modules() if isinstance(m, ReferenceExperts)}
