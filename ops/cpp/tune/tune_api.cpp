// libcim_int4_tune.so: the `cim-int4 tune` command's entry points (Python loads them with
// ctypes, cim_int4.ops.tuning). Replies are JSON written into the caller's buffer.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

#include "kernels/kernel.h"
#include "tune/profile.h"
#include "tune/tuner.h"

namespace {

// Copies `reply` into out[cap]; returns its length (the caller retries with a larger buffer
// when that is >= cap).
int reply(const std::string& text, char* out, size_t cap) {
  if (cap > 0) {
    const size_t n = text.size() < cap - 1 ? text.size() : cap - 1;
    std::memcpy(out, text.data(), n);
    out[n] = '\0';
  }
  return static_cast<int>(text.size());
}

// CIM_INT4_TUNE_STREAM_MIB=<n>: the synthetic stream's size in MiB instead of twice the
// last-level cache, for the explicit `cim-int4 tune` only (the op's implicit tuning ignores
// it), so a test or a measurement can run the large-cache path on any machine. Returns 0
// (the default) when unset; false with `error` set when it is not a whole number in 1..4096.
bool forced_stream_bytes(int64_t& bytes, std::string& error) {
  bytes = 0;
  const char* text = std::getenv("CIM_INT4_TUNE_STREAM_MIB");
  if (text == nullptr || *text == '\0') return true;
  char* end = nullptr;
  const long mib = std::strtol(text, &end, 10);
  if (*end != '\0' || mib < 1 || mib > 4096) {
    error = std::string("CIM_INT4_TUNE_STREAM_MIB=") + text + " is not a whole number of MiB in 1..4096";
    return false;
  }
  bytes = int64_t(mib) << 20;
  return true;
}

int error_reply(const std::string& message, char* out, size_t cap) {
  return reply("{\"error\": " + cim::json_quoted(message) + "}", out, cap);
}

const cim::KernelTable* table_named(const char* kernel, std::string& error) {
  const char* available = nullptr;
  const cim::KernelTable* t = cim::select_kernels(kernel, &available);
  if (t == nullptr) error = std::string("kernel '") + kernel + "' is not one this CPU runs; available: " + available;
  return t;
}

}  // namespace

// Times `kernel`'s variants ("auto": the best table this CPU runs) for about `budget_seconds`
// and, when `save` is nonzero, stores the choice in the profile. Reply: the report.
extern "C" __attribute__((visibility("default"))) int cim_int4_tune(const char* kernel, double budget_seconds,
                                                                     int save, char* out, size_t cap) {
  try {
    std::string error;
    const cim::KernelTable* table = table_named(kernel, error);
    if (table == nullptr) return error_reply(error, out, cap);
    if (!(std::isfinite(budget_seconds) && budget_seconds > 0)) {
      return error_reply("tune: budget_seconds must be a positive finite number of seconds, got " +
                             std::to_string(budget_seconds),
                         out, cap);
    }
    cim::TuneOptions options;
    options.budget_seconds = budget_seconds;
    if (!forced_stream_bytes(options.stream_bytes, error)) return error_reply(error, out, cap);
    const cim::TuneReport r = cim::tune(*table, options);
    const std::string path = cim::profile_path();
    const std::string save_error = save ? cim::save_choice(path, r) : "";
    std::ostringstream j;
    j.precision(9);
    j << "{\"cpu\": " << cim::json_quoted(cim::this_cpu().name) << ", \"key\": " << cim::json_quoted(cim::this_cpu().key)
      << ", \"kernel\": " << cim::json_quoted(r.table) << ", \"stream_bytes\": " << r.stream_bytes
      << ", \"window_bytes\": " << r.window_bytes << ", \"windows\": " << r.windows << ", \"llc_bytes\": " << r.llc_bytes << ", \"rounds\": " << r.rounds << ", \"extended\": " << (r.extended ? "true" : "false") << ", \"budget_seconds\": " << budget_seconds
      << ", \"setup_seconds\": " << r.setup_seconds << ", \"elapsed_seconds\": " << r.elapsed_seconds
      << ", \"longest_round_seconds\": " << r.longest_round_seconds << ", \"read_seconds\": " << r.read_seconds
      << ", \"margin\": " << cim::kTuneMargin << ", \"min_rounds\": " << cim::kTuneMinRounds << ", \"drop_factor\": " << cim::kTuneDropFactor
      << ", \"extend_factor\": " << cim::kTuneExtendFactor << ", \"variants\": [";
    for (size_t i = 0; i < r.rows.size(); ++i) {
      j << (i ? ", " : "") << "{\"name\": " << cim::json_quoted(r.rows[i].name) << ", \"fp32_seconds\": " << r.rows[i].seconds[cim::kFp32]
        << ", \"int8_seconds\": " << r.rows[i].seconds[cim::kInt8] << ", \"fp32_vs_default\": "
        << r.rows[i].vs_default[cim::kFp32] << ", \"int8_vs_default\": " << r.rows[i].vs_default[cim::kInt8]
        << ", \"fp32_rounds\": " << r.rows[i].rounds[cim::kFp32] << ", \"int8_rounds\": " << r.rows[i].rounds[cim::kInt8] << "}";
    }
    j << "], \"default\": {\"fp32\": " << cim::json_quoted(table->default_variant(cim::kFp32).name)
      << ", \"int8\": " << cim::json_quoted(table->default_variant(cim::kInt8).name) << "}, \"chosen\": {\"fp32\": "
      << cim::json_quoted(r.rows[r.chosen[cim::kFp32]].name) << ", \"int8\": " << cim::json_quoted(r.rows[r.chosen[cim::kInt8]].name)
      << "}, \"profile\": " << cim::json_quoted(path) << ", \"saved\": " << (save && save_error.empty() ? "true" : "false")
      << ", \"save_error\": " << cim::json_quoted(save_error) << "}";
    return reply(j.str(), out, cap);
  } catch (const std::exception& e) {
    return error_reply(e.what(), out, cap);
  }
}

// The variants `kernel` runs in this process, as the op decides them (CIM_INT4_VARIANT,
// the profile, else a tuning when CIM_INT4_TUNE allows), and the table's untuned defaults.
// Reply: {"kernel", "fp32", "int8", "default": {"fp32", "int8"}, "source", "message", "cpu",
// "key", "profile"} or {"error"}.
extern "C" __attribute__((visibility("default"))) int cim_int4_variants(const char* kernel, char* out, size_t cap) {
  try {
    std::string error;
    const cim::KernelTable* table = table_named(kernel, error);
    if (table == nullptr) return error_reply(error, out, cap);
    cim::VariantChoice c;
    if (!cim::choose_variants(*table, c, error)) return error_reply(error, out, cap);
    return reply("{\"kernel\": " + cim::json_quoted(table->name) + ", \"fp32\": " + cim::json_quoted(c.variant[cim::kFp32]->name) +
                     ", \"int8\": " + cim::json_quoted(c.variant[cim::kInt8]->name) +
                     ", \"default\": {\"fp32\": " + cim::json_quoted(table->default_variant(cim::kFp32).name) +
                     ", \"int8\": " + cim::json_quoted(table->default_variant(cim::kInt8).name) + "}" +
                     ", \"source\": " + cim::json_quoted(c.source) +
                     ", \"message\": " + cim::json_quoted(c.message) + ", \"cpu\": " + cim::json_quoted(cim::this_cpu().name) +
                     ", \"key\": " + cim::json_quoted(cim::this_cpu().key) + ", \"profile\": " + cim::json_quoted(cim::profile_path()) +
                     "}",
                 out, cap);
  } catch (const std::exception& e) {
    return error_reply(e.what(), out, cap);
  }
}
