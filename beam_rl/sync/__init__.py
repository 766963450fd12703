"""Weight sync into running vLLM servers: typed payloads and the strategy interface (`base`), one
strategy per file (`disk`, `lora`, `nccl`), sources (`sources`: HF dir, Megatron conversion, LoRA)
and the all-or-nothing orchestrator with the `beam-rl sync` command (`run`)."""
