#!/usr/bin/env bash
# Rebuild the real-LLM figures of docs/widths.md "Rotation" (SmolLM2-135M): GPTQ exports with and
# without rotate=True at 3 bits (group 64), rotated at 3 bits group 128 and 4 bits group 32, and
# rotated bits="auto" under a 3.0 budget, each scored as a multiple of MatMulNBits RTN's perplexity gap
# on 8,192 tokens of the evaluation text (calibration: 8 windows of calib.txt; 4 for the auto export).
#   tools/widths_rotate_figures.sh [ROOT] [OUT]      # defaults /work/real and ROOT/widths-rotate
# (the unrotated GPTQ 4-bit row of that table is docs/methods.md's, tools/measure_methods.py)
# ROOT as tools/real_llm_models.py and tools/real_llm_text.py leave it. Time on a 2-vCPU Zen 4: each
# uniform export 2-3 min, the auto export ~36 min, scoring ~3 min a model.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-/work/real}
out=${2:-$root/widths-rotate}
py=.venv/bin/python
fp32=$root/smollm2/fp32
gptq='"method": "gptq", "scale_rule": "mse", "target_cosine": 0.0'
$py tools/widths_real_llm.py export "$fp32" "$out" --calib "$root/text/calib.txt" --windows 8 \
    --variant gptq3-g64 "{$gptq, \"group_size\": 64, \"bits\": 3}" \
    --variant rot-gptq3-g64 "{$gptq, \"rotate\": true, \"group_size\": 64, \"bits\": 3}" \
    --variant rot-gptq3-g128 "{$gptq, \"rotate\": true, \"group_size\": 128, \"bits\": 3}" \
    --variant rot-gptq4 "{$gptq, \"rotate\": true}"
$py tools/widths_real_llm.py export "$fp32" "$out" --calib "$root/text/calib.txt" --windows 4 \
    --variant rot-auto30-g64 '{"method": "gptq", "scale_rule": "mse", "rotate": true, "group_size": 64, "bits": "auto", "bits_budget": 3.0}'
$py tools/widths_real_llm.py score "$fp32" "$out" gptq3-g64 rot-gptq3-g64 rot-gptq3-g128 rot-gptq4 rot-auto30-g64 \
    --rtn "$root/smollm2/int4" --text "$root/text/eval.txt" --max-tokens 8192 --threads 2 --per-call 2
