#!/usr/bin/env bash
# R3 gap on one H200: beam-mini, 64 sequences x 512 generated tokens, temperature 1, modes
# bf16 / lora / mxfp8 (emulated), R3 on and off. Status: NOT YET RUN.
#
# Prerequisite (once per fresh machine): the gpu-kit of ../shared/gpu-kit unpacked and exported
# (vLLM 0.26.0 + megatron-core 0.16.1; see its README), i.e. the last kit command was
#     bash .kit/03/unpack.sh --install .kit/03 && export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0
# Then, from the repository root:
#     bash scripts/gap_h200.sh            # ~3 x (60 s engine start + generation + recompute)
# Results: runs/gap_h200/{bf16,lora,mxfp8}.json and .png, summary.md (copy into docs/benchmarks.md).
#
# Bars (issue 6): R3 on mean |delta| <= 0.005 for bf16 and lora, <= 0.015 for mxfp8.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gap_h200}
MODES=${MODES:-"bf16 lora mxfp8"}
export VLLM_USE_FLASHINFER_SAMPLER=0      # avoids a minutes-long nvcc build of FlashInfer's sampler
export PYTHONPATH=${PYTHONPATH:-/tmp/site}
mkdir -p "$OUT"

# beam_rl.rollout must be importable and its vLLM plugin entry point registered: an editable
# install without touching dependencies (no registry needed; setuptools is in the image).
python -c "import beam_rl.rollout, importlib.metadata as m; assert any(e.name == 'beam_rl' for e in m.entry_points(group='vllm.general_plugins'))" 2>/dev/null \
  || python -m pip install --no-deps --no-build-isolation --no-index -q -e .
python -c "import torch, vllm, megatron.core; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name())"

for mode in $MODES; do
  echo "== beam-mini gap, mode $mode ==" >&2
  python -m beam_rl.cli gap --preset beam-mini --mode "$mode" --seed 0 \
    --num-prompts 64 --min-prompt-len 32 --max-prompt-len 256 --max-tokens 512 \
    --micro-batch 8 --gpu-memory-utilization 0.4 \
    --histogram "$OUT/$mode.png" --json --no-progress > "$OUT/$mode.json"
done

python - "$OUT" $MODES <<'EOF'
import json, sys
out, modes = sys.argv[1], sys.argv[2:]
bars = {"bf16": 0.005, "lora": 0.005, "mxfp8": 0.015}
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
text = "\n".join(rows)
open(f"{out}/summary.md", "w").write(text + "\n")
print(text)
EOF
