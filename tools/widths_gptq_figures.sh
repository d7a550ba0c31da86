#!/usr/bin/env bash
# Rebuild the real-LLM figures of docs/widths.md "GPTQ at every width" (SmolLM2-135M): GPTQ exports
# at 4 bits (groups 32 and 64), 3 bits (group 64) and bits="auto" under a 3.0 budget, their
# perplexity gap as a multiple of MatMulNBits RTN's on 8,192 tokens of the evaluation text, and
# genai decode tokens/s of the 4.5-bit one beside the builder's MatMulNBits (accuracy level 4).
#   tools/widths_gptq_figures.sh [ROOT] [OUT]      # defaults /work/real and ROOT/widths-gptq
# ROOT as tools/real_llm_models.py and tools/real_llm_text.py leave it. Time on a 2-vCPU Zen 3:
# uniform exports 1-2.5 min each, each bits="auto" export about 30 min (1,224 probe runs), scoring
# about 5 min per three models, decode a few minutes. Peak memory ~3.4 GB (the auto exports).
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-/work/real}
out=${2:-$root/widths-gptq}
py=.venv/bin/python
fp32=$root/smollm2/fp32
gptq='"method": "gptq", "scale_rule": "mse"'
$py tools/widths_real_llm.py export "$fp32" "$out" --calib "$root/text/calib.txt" --windows 8 \
    --variant gptq4 "{$gptq, \"target_cosine\": 0.0}" \
    --variant gptq4-g64 "{$gptq, \"group_size\": 64, \"target_cosine\": 0.0}" \
    --variant gptq3-g64 "{$gptq, \"group_size\": 64, \"bits\": 3, \"target_cosine\": 0.0}" \
    --variant auto30-gptq-g64 "{$gptq, \"group_size\": 64, \"bits\": \"auto\", \"bits_budget\": 3.0}" \
    --variant auto30-gptq-g32 "{$gptq, \"bits\": \"auto\", \"bits_budget\": 3.0}"
for names in "gptq4 gptq4-g64" "gptq3-g64 auto30-gptq-g64 auto30-gptq-g32"; do
    # shellcheck disable=SC2086
    $py tools/widths_real_llm.py score "$fp32" "$out" $names --rtn "$root/smollm2/int4" \
        --text "$root/text/eval.txt" --max-tokens 8192 --threads 2
done
for v in gptq4 gptq4-g64; do
    [ -d "$out/genai-$v" ] || $py tools/genai_folder.py "$out/$v" "$out/genai-$v" --compute int8
done
[ -d "$out/genai-default" ] || .venv/bin/cim-int4 genai "$fp32" -o "$out/genai-default" -q
$py tools/decode_folders.py --threads 1 2 --rounds 5 \
    "MatMulNBits acc4=$root/smollm2/int4" "default=$out/genai-default" "gptq4=$out/genai-gptq4" "gptq4-g64=$out/genai-gptq4-g64" \
    --json "$out/decode.json"
