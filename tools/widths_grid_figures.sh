#!/usr/bin/env bash
# Rebuild the real-LLM rows of docs/widths.md "Non-uniform 3-bit codes (grid="normal") and GPTQ's
# weighted scales" (SmolLM2-135M): GPTQ exports at 4 bits (plain and rotated) and rotated at 3 bits
# group 64 on the uniform and the normal grid, scored as a multiple of MatMulNBits RTN's perplexity
# gap on 8,192 tokens of the evaluation text (calibration: 8 windows of calib.txt). The "unweighted"
# rows are those of main before the weighting (ecc36a4), rebuilt by checking that out. Since 2026-12-05
# 16:00 the 3-bit rows carry the weighted super-scales and the 8-bit fold, and rot-gptq3n-auto300 is
# bits="auto" at 3.0 with the KL damage, the proxy anchored at 3 bits and the fold as a candidate (the doc's auto rows took budget 2.93
# with the fold FP32: the same 3.0 in all). bits="auto" alone takes 35-70 min on 2 vCPUs.
#   tools/widths_grid_figures.sh [ROOT] [OUT]      # defaults /work/real and ROOT/widths-grid
# ROOT as tools/real_llm_models.py and tools/real_llm_text.py leave it. Time on a 2-vCPU Zen 4: each
# export 1.5-5 min, scoring ~3 min a model.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-/work/real}
out=${2:-$root/widths-grid}
py=.venv/bin/python
gptq='"method": "gptq", "scale_rule": "mse", "target_cosine": 0.0'
$py tools/widths_real_llm.py export "$root/smollm2/fp32" "$out" --calib "$root/text/calib.txt" --windows 8 \
    --variant gptq4 "{$gptq}" \
    --variant rot-gptq4 "{$gptq, \"rotate\": true}" \
    --variant rot-gptq3-g64 "{$gptq, \"rotate\": true, \"group_size\": 64, \"bits\": 3}" \
    --variant rot-gptq3n-g64 "{$gptq, \"rotate\": true, \"group_size\": 64, \"bits\": 3, \"grid\": \"normal\"}" \
    --variant rot-gptq3n-auto300 "{$gptq, \"rotate\": true, \"group_size\": 64, \"grid\": \"normal\", \"bits\": \"auto\", \"bits_budget\": 3.0}"
$py tools/widths_real_llm.py score "$root/smollm2/fp32" "$out" gptq4 rot-gptq4 rot-gptq3-g64 rot-gptq3n-g64 rot-gptq3n-auto300 \
    --rtn "$root/smollm2/int4" --text "$root/text/eval.txt" --max-tokens 8192 --threads 2 --per-call 2
