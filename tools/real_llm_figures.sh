#!/usr/bin/env bash
# Rebuild every real-LLM figure of docs/real-llm.md ("Group 32 on 8,192 tokens", `auto` with
# feeds, genai decode) from the models and text under ROOT (tools/real_llm_models.py,
# tools/real_llm_text.py; llama.cpp's Q4_0 GGUFs from tools/real_llm_llamacpp.py).
#   tools/real_llm_figures.sh [ROOT] [OUT]      # defaults /work/real and ROOT/figures
# Run it on a quiet machine: the perplexity steps take about 10 minutes per model there (each
# model is run on every window, Gemma's FP32 logits are 0.5 GB a window) and the decode step
# times every variant interleaved. Peak memory: ~5 GB (Gemma, three models per call) and ~6 GB
# while `auto` with feeds exports SmolLM2, ~10 GB while `methodauto` exports Gemma (21 min on Zen 3). Results: OUT/NAME/ppl/*.json, OUT/NAME/decode/*.json,
# and the markdown tables on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-/work/real}
out=${2:-$root/figures}
py=.venv/bin/python
labels=nbits-acc4-g32,nbits-acc0-g32,signed-g32-fp32,mse-g32-fp32,balanced-g32-fp32,balanced@0.03-g32-fp32
labels=$labels,balanced@0.003-g32-fp32,autofeeds-g32-fp32,methodauto-g32-fp32
for name in smollm2 gemma3; do
    $py tools/real_llm.py exports "$name" --root "$root" --out "$out" --groups 32 \
        --rules signed mse balanced balanced@0.03 balanced@0.003 autofeeds methodauto
    # The FP32 model runs once per call: three int4 models per call bound Gemma's memory.
    $py tools/real_llm.py measure "$name" --root "$root" --out "$out" --max-tokens 8192 --threads 2 \
        --group 3 --only "$labels"
    $py tools/real_llm.py measure "$name" --root "$root" --out "$out" --max-tokens 8192 --threads 2 \
        --only balanced-g32-int8
    $py tools/real_llm.py decode "$name" --root "$root" --out "$out" --rounds 3
done
$py tools/real_llm.py table smollm2 gemma3 --root "$root" --out "$out"
