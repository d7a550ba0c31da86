#!/bin/bash
# Decode tokens/s of genai folders beside llama.cpp Q4_0, interleaved per round (docs/real-llm.md,
# "gated MLPs in one node"):
#
#   tools/decode_anchor.sh ROUNDS LLAMA_BIN NAME=INT4_FOLDER:LABEL=FOLDER:...:Q4_0.gguf ...
#
# For each round and each model: tools/decode_folders.py on its folders (the first is the ratios'
# base, 3 inner rounds, 1 and 2 threads), then `llama-bench -p 0 -n 32 -r 3` of its GGUF at 1 and 2
# threads; with GREEDY=PATH (tools/llama_greedy.cpp built), also llama.cpp's own greedy loop
# (a token sampled before the next is decoded, as the genai loop does) at 1 and 2 threads.
# Example (the figures of 2026-12-03):
#   tools/decode_anchor.sh 3 LLAMA/build/bin \
#     smollm2=acc4=/work/real/smollm2/int4:unfused=/work/s23/smol-new:fused=/work/s23/smol-gen:/work/real/llama.cpp/smollm2/Q4_0.gguf
set -euo pipefail
rounds=$1; bin=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python}
for r in $(seq 1 "$rounds"); do
  for spec in "$@"; do
    name=${spec%%=*}; rest=${spec#*=}
    IFS=: read -r -a parts <<< "$rest"
    gguf=${parts[-1]}; unset 'parts[-1]'
    echo "== round $r $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    "$python" "$here/decode_folders.py" "${parts[@]}" --rounds 3 | grep thread
    for t in 1 2; do
      "$bin/llama-bench" -m "$gguf" -p 0 -n 32 -t "$t" -r 3 -o csv 2>/dev/null | tail -1 |
        awk -F, -v t="$t" '{gsub(/"/, "", $(NF-1)); print "llama.cpp Q4_0 " t " thread(s) tg32 " $(NF-1) " tok/s"}'
      if [ -n "${GREEDY:-}" ]; then "$GREEDY" "$gguf" "$t" 3 32 | tail -1; fi
    done
  done
done
