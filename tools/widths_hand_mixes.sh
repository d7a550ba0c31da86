#!/usr/bin/env bash
# Rebuild docs/widths.md "Hand-made mixes at 3.0 bits per weight" (SmolLM2-135M): every layer at 3 bits but one
# role at 2 (the tied embedding / LM head, the MLP down, up, or attention projections), each about 0.19 bits per
# weight, the step from uniform 3-bit (3.19) to 3.0. Rotated GPTQ, scale rule mse, normal grid, group 64, int8
# scales, 8 calibration windows of calib.txt; scored as a multiple of MatMulNBits RTN's perplexity gap on 8,192
# tokens of eval.txt. The rotation's fold keeps its 8 bits (a catch-all '.*' does not name it since e280782).
#   tools/widths_hand_mixes.sh [ROOT] [OUT]      # defaults /work/real and ROOT/widths-mixes
# ROOT as tools/real_llm_models.py and tools/real_llm_text.py leave it. Time on a 2-vCPU Zen 4: each export
# 4-11 min, scoring ~3 min a model.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-/work/real}
out=${2:-$root/widths-mixes}
py=.venv/bin/python
base='"method": "gptq", "scale_rule": "mse", "target_cosine": 0.0, "rotate": true, "group_size": 64, "grid": "normal"'
$py tools/widths_real_llm.py export "$root/smollm2/fp32" "$out" --calib "$root/text/calib.txt" --windows 8 \
    --variant rot-3n-head2 "{$base, \"bits\": {\"/model/embed_tokens/Gather\": 2, \"/lm_head/MatMul\": 2, \".*\": 3}}" \
    --variant rot-3n-down2 "{$base, \"bits\": {\".*down_proj.*\": 2, \".*\": 3}}" \
    --variant rot-3n-up2 "{$base, \"bits\": {\".*up_proj.*\": 2, \".*\": 3}}" \
    --variant rot-3n-attn2 "{$base, \"bits\": {\".*attn.*\": 2, \".*\": 3}}"
$py tools/widths_real_llm.py score "$root/smollm2/fp32" "$out" rot-3n-head2 rot-3n-down2 rot-3n-up2 rot-3n-attn2 \
    --rtn "$root/smollm2/int4" --text "$root/text/eval.txt" --max-tokens 8192 --threads 1
