#!/usr/bin/env bash
# R3 gap on one H200: beam-mini, 64 sequences x 512 generated tokens, temperature 1, modes
# bf16 / lora / mxfp8 (emulated), R3 on and off; then where the bf16 gap comes from
# (scripts/gap_sources.py: one rollout, several trainer definitions and the FP64 reference).
#
# Prerequisites on the GPU machine: the gpu-kit (vLLM 0.26.0 + megatron-core 0.16.1, see
# ../shared/gpu-kit/README.md) unpacked, and beam-rl importable with its vLLM plugin registered
# (an installed wheel; running from the repository root would shadow the installed package with
# the source tree, where `beam_rl.rollout` does not exist, so this script runs from $WORK).
#     export PYTHONPATH=/tmp/beam:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0
#     bash scripts/gap_h200.sh                   # OUT=runs/gap_h200 MODES="bf16 lora mxfp8" SOURCES=1 [CKPT=dir PROMPTS=file]
#                                                # TRAINER_ATTENTION=engine|flash|auto (beam-rl gap --trainer-attention; default auto)
# Results: $OUT/{bf16,lora,mxfp8}.json and .png, $OUT/sources.json, $OUT/summary.md.
#
# Bars: the `trained` column of beam_rl/gap/bounds.py (R3 on mean |delta| per mode), read below.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${OUT:-$REPO/runs/gap_h200}" && cd "${OUT:-$REPO/runs/gap_h200}" && pwd)
MODES=${MODES:-"bf16 lora mxfp8"}
SOURCES=${SOURCES:-1}
WORK=${WORK:-/tmp/beam-gap}
CKPT=${CKPT:-$WORK/beam-mini}
export VLLM_USE_FLASHINFER_SAMPLER=0      # avoids a minutes-long nvcc build of FlashInfer's sampler
mkdir -p "$WORK" && cd "$WORK"
python3 -c "import beam_rl.rollout, importlib.metadata as m; assert any(e.name == 'beam_rl' for e in m.entry_points(group='vllm.general_plugins'))" \
  || { echo "beam_rl.rollout or its vllm.general_plugins entry point is missing: install the beam-rl wheel" >&2; exit 1; }
python3 -c "import torch, vllm, megatron.core; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name())"
[ -f "$CKPT/config.json" ] || python3 -m beam_rl.cli init --preset beam-mini --seed 0 --out "$CKPT"

# PROMPTS=FILE: a JSON list of token-id lists (e.g. scripts/pretrain_bytes.py --prompts-out) instead of the seeded set
if [ -n "${PROMPTS:-}" ]; then PROMPT_ARGS=(--prompts "$PROMPTS"); else PROMPT_ARGS=(--num-prompts 64 --min-prompt-len 32 --max-prompt-len 256); fi
COMMON=(--checkpoint "$CKPT" --seed 0 "${PROMPT_ARGS[@]}" --max-tokens 512)
for mode in $MODES; do
  echo "== beam-mini gap, mode $mode ==" >&2
  python3 -m beam_rl.cli gap "${COMMON[@]}" --mode "$mode" --micro-batch 8 --gpu-memory-utilization 0.4 \
    --trainer-attention "${TRAINER_ATTENTION:-auto}" --histogram "$OUT/$mode.png" --json --no-progress > "$OUT/$mode.json"
done
if [ "$SOURCES" = 1 ]; then
  echo "== beam-mini gap sources (bf16) ==" >&2
  python3 "$REPO/scripts/gap_sources.py" "${COMMON[@]}" --json > "$OUT/sources.json"  # every attention, whatever TRAINER_ATTENTION
fi

python3 - "$OUT" $MODES <<'PY'
import json, os, sys
from beam_rl.gap.bounds import BOUNDS
out, modes = sys.argv[1], sys.argv[2:]
bars = {mode: b.trained for mode, b in BOUNDS.items()}  # the bar for a trained checkpoint
rows = ["| mode | R3 | mean abs d | max abs d | extreme (>ln 2) | router disagreement | seq KL k3 | tokens | bar |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
for mode in modes:
    r = json.load(open(f"{out}/{mode}.json"))
    for side in ("r3_on", "r3_off"):
        s = r[side]
        bar = (("pass" if s["mean_abs_logprob_diff"] <= bars[mode] else "FAIL") + f" (<= {bars[mode]})") if side == "r3_on" else ""
        rows.append(f"| {mode} | {side[3:]} | {s['mean_abs_logprob_diff']:.2e} | {s['max_abs_logprob_diff']:.2e} | "
                    f"{s['extreme_token_fraction']:.3%} | {s['router_disagreement']:.3%} | {s['seq_kl_k3']:.2e} | {s['num_tokens']} | {bar} |")
    if "lora_effect_mean_abs_logprob" in r:
        rows.append(f"| lora | adapter effect (trainer with vs without) | {r['lora_effect_mean_abs_logprob']:.2e} | | | | | | |")
if os.path.exists(f"{out}/sources.json"):
    rows += ["", "| trainer (same rollout, R3 on) | mean abs d | max abs d | mean d |", "| --- | ---: | ---: | ---: |"]
    for name, s in json.load(open(f"{out}/sources.json")).items():
        rows.append(f"| {name} | {s['mean_abs_logprob_diff']:.2e} | {s['max_abs_logprob_diff']:.2e} | {s['mean_logprob_diff']:+.2e} |")
text = "\n".join(rows)
open(f"{out}/summary.md", "w").write(text + "\n")
print(text)
PY
