"""`BeamConfig`: the HF config of Beam checkpoints, with validation that names the bad field.

The keys are exactly those of the released `config.json` (see docs/beam-model.md in shared/).
Every check raises `BeamConfigError` naming the field and how to fix it; a config that passes
can be built by every engine in this repository.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from beam_rl.errors import InputError

LAYER_TYPES = ("sliding_attention", "full_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
# Head sizes every attention backend we target supports (vLLM's CPU attention is the narrowest).
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class BeamConfigError(InputError):
    """A Beam config field is invalid; the message names the field and the fix."""


_INT = "a positive integer"
# Every key of a released config.json that defines the model, with its JSON type: a checkpoint's
# config must state each one (a missing key would silently take the 501B preset's value).
CHECKPOINT_KEYS: dict[str, str] = {
    **{k: _INT for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
                         "moe_intermediate_size", "num_experts_per_tok", "num_experts", "n_group", "topk_group")},
    "hidden_act": "a string", "rms_norm_eps": "a number", "tie_word_embeddings": "true or false",
    "norm_topk_prob": "true or false", "routed_scaling_factor": "a number", "final_logit_softcapping": "a number or null",
    "layer_types": "a list of strings", "mlp_layer_types": "a list of strings", "rope_parameters": "a mapping",
}


def _has_type(value, kind: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {
        _INT: isinstance(value, int) and not isinstance(value, bool),
        "a string": isinstance(value, str),
        "a number": number,
        "a number or null": value is None or number,
        "true or false": isinstance(value, bool),
        "a list of strings": isinstance(value, list) and all(isinstance(v, str) for v in value),
        "a mapping": isinstance(value, dict),
    }[kind]


def check_checkpoint_dict(d: dict, source: str = "config.json") -> None:
    """Refuse a checkpoint config that is not a complete, well-typed Beam config: `model_type` must be
    "beam" and every key of `CHECKPOINT_KEYS` present with its JSON type (no "true" strings, no 8.0
    for an integer). The message names the source, the key and the fix."""
    if not isinstance(d, dict):
        raise BeamConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
    if d.get("model_type") != "beam":
        raise BeamConfigError(f"{source}: model_type is {d.get('model_type')!r}; a Beam checkpoint has model_type \"beam\"")
    missing = [k for k in CHECKPOINT_KEYS if k not in d]
    if missing:
        raise BeamConfigError(f"{source}: missing key(s) {missing}; a Beam config.json states every key that defines the "
                              f"model (write it with BeamConfig.save_pretrained)")
    for key, kind in CHECKPOINT_KEYS.items():
        if not _has_type(d[key], kind):
            raise BeamConfigError(f"{source}: {key} must be {kind}, got {d[key]!r} ({type(d[key]).__name__})")


class BeamConfig(PretrainedConfig):
    """Config of a Beam decoder (HF `model_type: "beam"`).

    Per-layer structure is explicit: `layer_types[i]` is `"sliding_attention"` (RoPE, window
    `sliding_window`) or `"full_attention"` (NoPE + SSMax), `mlp_layer_types[i]` is `"dense"`
    (SwiGLU, `intermediate_size`) or `"sparse"` (MoE, `num_experts` x `moe_intermediate_size`).
    """

    model_type = "beam"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 5120,
        intermediate_size: int = 20480,
        num_hidden_layers: int = 52,
        num_attention_heads: int = 48,
        num_key_value_heads: int = 8,
        head_dim: int = 128,
        hidden_act: str = "silu",
        max_position_embeddings: int = 1048576,
        rms_norm_eps: float = 1e-6,
        tie_word_embeddings: bool = False,
        sliding_window: int = 512,
        layer_types: list[str] | None = None,
        mlp_layer_types: list[str] | None = None,
        moe_intermediate_size: int = 2560,
        num_experts_per_tok: int = 8,
        num_experts: int = 256,
        norm_topk_prob: bool = True,
        n_group: int = 8,
        topk_group: int = 4,
        routed_scaling_factor: float = 2.5,
        final_logit_softcapping: float | None = None,
        rope_parameters: dict | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.sliding_window = sliding_window
        self.layer_types = list(layer_types) if layer_types is not None else default_layer_types(num_hidden_layers)
        self.mlp_layer_types = (
            list(mlp_layer_types) if mlp_layer_types is not None else default_mlp_layer_types(num_hidden_layers)
        )
        self.moe_intermediate_size = moe_intermediate_size
        self.num_experts_per_tok = num_experts_per_tok
        self.num_experts = num_experts
        self.norm_topk_prob = norm_topk_prob
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.final_logit_softcapping = final_logit_softcapping
        self.rope_parameters = normalize_rope_parameters(rope_parameters)
        self.initializer_range = initializer_range
        self.tie_word_embeddings = tie_word_embeddings
        # Ours first: transformers' own validators would reject some fields with less precise messages.
        self.validate_beam()
        kwargs.setdefault("architectures", ["BeamForCausalLM"])
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """HF's loading path (AutoConfig, vLLM): strict about the keys that define Beam."""
        check_checkpoint_dict(config_dict)
        return super().from_dict(config_dict, **kwargs)

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["rope_parameters"] = {**out["rope_parameters"], "full_attention": None}  # the released layout
        return out

    def standardize_rope_params(self):
        """Already standard (see `normalize_rope_parameters`); transformers 5.17's version indexes
        every layer type, NoPE ones included (vLLM calls it)."""

    def validate_rope(self):
        """`validate_beam` checks rope_parameters; transformers' check differs across versions."""

    def convert_rope_params_to_dict(self, **kwargs):
        # transformers' generic converter assumes a flat rope_parameters and would add top-level
        # RoPE keys to Beam's per-layer-type mapping (transformers' own Beam config does the same).
        return kwargs

    # -- derived quantities used everywhere -------------------------------------------------
    @property
    def sliding_rope_theta(self) -> float:
        """RoPE base of the sliding-window layers (full-attention layers are NoPE)."""
        return float(self.rope_parameters["sliding_attention"]["rope_theta"])

    @property
    def moe_layer_ids(self) -> list[int]:
        """0-based indices of the MoE layers, in order; routing tensors use this order."""
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]

    @property
    def full_attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    # -- validation ----------------------------------------------------------------------------
    def validate_beam(self) -> None:
        """Raise `BeamConfigError` naming the first invalid field and how to fix it."""

        def fail(field: str, msg: str) -> None:
            raise BeamConfigError(f"BeamConfig.{field}: {msg}")

        for field in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
            "moe_intermediate_size", "num_experts_per_tok", "num_experts", "n_group", "topk_group",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(field, f"must be a positive integer, got {value!r}")
        if self.hidden_act != "silu":
            fail("hidden_act", f"Beam uses SwiGLU; set it to 'silu' (got {self.hidden_act!r})")
        if self.tie_word_embeddings:
            fail("tie_word_embeddings", "Beam's LM head is untied; set it to false")
        if not self.rms_norm_eps > 0:
            fail("rms_norm_eps", f"must be > 0, got {self.rms_norm_eps!r}")
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            fail("head_dim", f"{self.head_dim} is not supported by the attention backends; use one of {SUPPORTED_HEAD_DIMS}")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads} (GQA needs whole groups)",
            )
        for field, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            types = getattr(self, field)
            if len(types) != self.num_hidden_layers:
                fail(field, f"has {len(types)} entries but num_hidden_layers={self.num_hidden_layers}; give one per layer")
            for i, t in enumerate(types):
                if t not in allowed:
                    fail(field, f"entry {i} is {t!r}; allowed values are {allowed}")
        if "full_attention" in self.rope_parameters:
            fail("rope_parameters.full_attention", "full-attention layers are NoPE (SSMax instead of RoPE); set it to null")
        if set(self.rope_parameters) != {"sliding_attention"}:
            fail("rope_parameters", f"expects keys 'sliding_attention' (and 'full_attention': null), got {sorted(self.rope_parameters)}")
        rope = self.rope_parameters["sliding_attention"]
        if not isinstance(rope, dict):
            fail("rope_parameters.sliding_attention", f"must be a mapping with rope_type and rope_theta, got {rope!r}")
        if rope.get("rope_type", "default") != "default":
            fail("rope_parameters.rope_type", f"only 'default' RoPE is implemented, got {rope.get('rope_type')!r}")
        if not isinstance(rope.get("rope_theta"), (int, float)) or rope["rope_theta"] <= 0:
            fail("rope_parameters.rope_theta", f"must be a positive number, got {rope.get('rope_theta')!r}")
        if self.num_experts % self.n_group:
            fail("n_group", f"{self.n_group} does not divide num_experts={self.num_experts}; groups must be equal")
        if self.topk_group > self.n_group:
            fail("topk_group", f"{self.topk_group} > n_group={self.n_group}; keep at most n_group groups")
        per_group = self.num_experts // self.n_group
        if per_group < 2:
            fail("n_group", f"groups are scored by their top-2 experts, so each needs >= 2 experts; got {per_group}")
        if self.num_experts_per_tok > self.topk_group * per_group:
            fail(
                "num_experts_per_tok",
                f"{self.num_experts_per_tok} experts cannot be picked from topk_group={self.topk_group} groups of "
                f"{per_group}; lower it or raise topk_group",
            )
        if self.num_experts > 65536:
            fail("num_experts", "routing ids are stored as uint16 at most; use <= 65536 experts")
        if not self.routed_scaling_factor > 0:
            fail("routed_scaling_factor", f"must be > 0, got {self.routed_scaling_factor!r}")
        cap = self.final_logit_softcapping
        if cap is not None and not cap > 0:
            fail("final_logit_softcapping", f"must be a positive number or null, got {cap!r}")


def normalize_rope_parameters(rope_parameters: dict | None) -> dict:
    """RoPE parameters keyed by layer type, holding only the RoPE layers: {"sliding_attention":
    {rope_type, rope_theta}}. The released layout also lists `"full_attention": null` (NoPE); it
    is accepted and written back by `to_dict`, but not held, because vLLM 0.26 and transformers
    5.17 iterate the per-layer-type entries without expecting a null one. A flat
    {rope_type, rope_theta} is accepted too."""
    if not rope_parameters:
        return {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    if "sliding_attention" in rope_parameters or "full_attention" in rope_parameters:
        nested = {k: (dict(v) if isinstance(v, dict) else v) for k, v in rope_parameters.items()}
        if "full_attention" in nested and nested["full_attention"] is None:
            del nested["full_attention"]
        return nested
    return {"sliding_attention": dict(rope_parameters)}


def default_layer_types(num_layers: int, full_every: int = 6) -> list[str]:
    """Beam's pattern: every `full_every`-th layer (1-based) and the last are full attention."""
    return [
        "full_attention" if (i + 1) % full_every == 0 or i == num_layers - 1 else "sliding_attention"
        for i in range(num_layers)
    ]


def default_mlp_layer_types(num_layers: int, num_dense: int = 3) -> list[str]:
    """Beam's pattern: the first `num_dense` layers are dense SwiGLU, the rest MoE."""
    return ["dense" if i < num_dense else "sparse" for i in range(num_layers)]


#END
