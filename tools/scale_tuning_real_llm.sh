#!/usr/bin/env bash
# Rebuild docs/widths.md "Scale tuning in the exporter" (SmolLM2-135M at 2.978 bits per weight): every decoder layer
# 3-bit, the tied embedding / LM head 2-bit, normal grid, group 64, int8 scales, rotated GPTQ (mse) on 8 calibration
# windows of calib.txt, then the scales trained by the export itself (tune_epochs=4, lr 2e-3) on the first 34
# windows (the last 2 held out). Scored through the op library in both compute modes on 8,192 tokens of eval.txt,
# beside the same export untuned (tools/widths_hand_mixes.sh's rot-3n-head2), FP32 and MatMulNBits RTN.
#   tools/scale_tuning_real_llm.sh [ROOT] [OUT]      # defaults /work/real and ROOT/scale-tuning
# ROOT as tools/real_llm_models.py and tools/real_llm_text.py leave it. Time on a 2-vCPU Zen 4: each export ~11 min,
# the tuning ~15 min more, scoring ~1 min a model and mode.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-/work/real}
out=${2:-$root/scale-tuning}
py=.venv/bin/python
mix='"bits": {"/model/embed_tokens/Gather": 2, "/lm_head/MatMul": 2, ".*": 3}'
base="\"method\": \"gptq\", \"scale_rule\": \"mse\", \"target_cosine\": 0.0, \"rotate\": true, \"group_size\": 64, \
\"grid\": \"normal\", $mix"
$py tools/widths_real_llm.py export "$root/smollm2/fp32" "$out" --calib "$root/text/calib.txt" --windows 8 \
    --variant rot-3n-head2 "{$base}" \
    --variant rot-3n-head2-tuned "{$base, \"tune_epochs\": 4, \"tune_lr\": 2e-3, \"tune_windows\": 34}"
for mode in fp32 int8; do
    .venv/bin/cim-int4 perplexity "$root/smollm2/fp32" "$root/smollm2/int4" "$out/rot-3n-head2" \
        "$out/rot-3n-head2-tuned" --text "$root/text/eval.txt" --max-tokens 8192 --threads 2 --compute $mode \
        --json "$out/perplexity-$mode.json"
done
