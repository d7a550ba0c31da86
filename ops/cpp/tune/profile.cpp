#include "tune/profile.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace cim {
namespace {

// Bump when the variant grid (kernels/variants.h) or the tuner's rule changes meaning:
// profiles re-tune. g3: the tuner always runs 3 rounds (g2's 0.4 s could run 2 and keep
// a default twice as slow as the best). g4: the 2 KiB prefetch rows (t4-pf2k, n4-pf2k),
// and NTA variants timed last in a round. g5: rounds go on (up to twice the budget) while a
// candidate leads the default in the median but not yet steadily; and the stream's scales
// before its codes in each group (kernel.h), which moved the variants' speeds, and int8
// scales (the exporter's default) on the tuner's stream instead of float32 ones. g6: the
// n4x2 rows (two strips' streams in flight). g7: fp32 mode over two strips too (the n4x2
// rows' fp32 entries, t4x2-pf12k).
constexpr const char* kGridVersion = "g7";
constexpr const char* kFormat = "cim-int4 kernel profile 1";

CpuIdentity probe_identity() {
  CpuIdentity id;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  char vendor[13] = {};
  if (__get_cpuid(0, &a, &b, &c, &d)) {
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
  }
  unsigned family = 0, model = 0;
  if (__get_cpuid(1, &a, &b, &c, &d)) {
    const unsigned base_family = (a >> 8) & 0xF, base_model = (a >> 4) & 0xF;
    family = base_family == 0xF ? base_family + ((a >> 20) & 0xFF) : base_family;
    model = (base_family == 0x6 || base_family == 0xF) ? base_model + (((a >> 16) & 0xF) << 4) : base_model;
  }
  char brand[49] = {};
  if (__get_cpuid(0x80000000, &a, &b, &c, &d) && a >= 0x80000004) {
    for (unsigned leaf = 0; leaf < 3; ++leaf) {
      __get_cpuid(0x80000002 + leaf, &a, &b, &c, &d);
      const unsigned regs[4] = {a, b, c, d};
      std::memcpy(brand + 16 * leaf, regs, 16);
    }
  }
  std::string name = brand;
  name.erase(0, name.find_first_not_of(' '));
  name.erase(name.find_last_not_of(' ') + 1);
  __builtin_cpu_init();
  std::string flags;
  auto flag = [&](bool on, const char* what) {
    if (!on) return;
    if (!flags.empty()) flags += '.';
    flags += what;
  };
  flag(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "avx2");
  flag(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"),
       "avx512");
  flag(__builtin_cpu_supports("avx512vnni"), "avx512vnni");
  flag(__builtin_cpu_supports("avxvnni"), "avxvnni");
  if (flags.empty()) flags = "base";
  id.key = std::string(vendor) + "-" + std::to_string(family) + "-" + std::to_string(model) + "-" + flags + "-" +
           kGridVersion;
  id.name = (name.empty() ? std::string("unnamed CPU") : name) + " (" + vendor + " family " +
            std::to_string(family) + " model " + std::to_string(model) + ")";
#else
  id.key = std::string("generic-") + kGridVersion;
  id.name = "non-x86 CPU";
#endif
  return id;
}

using Entries = std::map<std::string, std::string>;

// A flat JSON object of strings. Returns "" or what is wrong with the text.
std::string parse_profile(const std::string& text, Entries& out) {
  size_t i = 0;
  auto skip = [&] {
    while (i < text.size() && std::strchr(" \t\r\n", text[i]) != nullptr) ++i;
  };
  auto at = [&] { return "at byte " + std::to_string(i); };
  auto string = [&](std::string& s) -> std::string {
    if (i >= text.size() || text[i] != '"') return "expected a string " + at();
    for (++i; i < text.size() && text[i] != '"'; ++i) {
      if (text[i] == '\\') {
        if (++i >= text.size()) break;
        const char* from = "\"\\/nt";
        const char* to = "\"\\/\n\t";
        const char* e = std::strchr(from, text[i]);
        if (e == nullptr) return "unsupported escape " + at();
        s += to[e - from];
      } else {
        s += text[i];
      }
    }
    if (i >= text.size()) return "unterminated string";
    ++i;
    return "";
  };
  skip();
  if (i >= text.size() || text[i] != '{') return "expected a JSON object of strings " + at();
  ++i;
  skip();
  if (i < text.size() && text[i] == '}') ++i;
  else {
    for (;;) {
      std::string key, value;
      skip();
      if (std::string e = string(key); !e.empty()) return e;
      skip();
      if (i >= text.size() || text[i] != ':') return "expected ':' " + at();
      ++i;
      skip();
      if (std::string e = string(value); !e.empty()) return e + " (every value is a string)";
      out[key] = value;
      skip();
      if (i < text.size() && text[i] == ',') {
        ++i;
        continue;
      }
      if (i < text.size() && text[i] == '}') {
        ++i;
        break;
      }
      return "expected ',' or '}' " + at();
    }
  }
  skip();
  if (i != text.size()) return "trailing text " + at();
  if (out.count("format") != 0 && out["format"] != kFormat) return "format is \"" + out["format"] + "\", expected \"" + kFormat + "\"";
  return "";
}

// Reads the profile at `path` into `out`; a missing file is an empty profile.
std::string read_profile(const std::string& path, Entries& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return errno == ENOENT ? "" : std::string("cannot read: ") + std::strerror(errno);
  std::stringstream text;
  text << f.rdbuf();
  return parse_profile(text.str(), out);
}

std::string make_dirs(const std::string& path) {
  for (size_t slash = path.find('/', 1); slash != std::string::npos; slash = path.find('/', slash + 1)) {
    const std::string dir = path.substr(0, slash);
    if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return "cannot create " + dir + ": " + std::strerror(errno);
  }
  return "";
}

std::string entry(const std::string& table, Mode mode) {
  return this_cpu().key + "/" + table + "/" + kModeNames[mode];
}

bool tuning_enabled() {
  const char* v = std::getenv("CIM_INT4_TUNE");
  return v == nullptr || (std::strcmp(v, "off") != 0 && std::strcmp(v, "0") != 0);
}

std::string variant_names(const KernelTable& table) {
  std::string names;
  for (int i = 0; i < table.variant_count; ++i) names += (i ? ", " : "") + std::string(table.variants[i].name);
  return names;
}

// From the profile at `path`; "" or a one-line note of what was wrong (then defaults).
// `found` says whether this CPU and table have entries.
std::string from_profile(const KernelTable& table, const std::string& path, VariantChoice& c, bool& found) {
  found = false;
  Entries entries;
  if (std::string problem = read_profile(path, entries); !problem.empty()) {
    found = true;  // never tune over (and so overwrite) a file we cannot read
    return "cim-int4: kernel profile " + path + ": " + problem +
           "; using the default kernel variants (fix or delete the file, or run `cim-int4 tune`)";
  }
  std::string note;
  for (Mode mode : {kFp32, kInt8}) {
    auto it = entries.find(entry(table.name, mode));
    if (it == entries.end()) continue;
    found = true;
    if (const KernelVariant* v = table.find_variant(it->second.c_str())) {
      c.variant[mode] = v;
    } else {
      note = "cim-int4: kernel profile " + path + ": '" + it->first + "' is \"" + it->second +
             "\", not a variant of this build (" + variant_names(table) + "); using " +
             c.variant[mode]->name + " (run `cim-int4 tune` to rewrite it)";
    }
  }
  return note;
}

}  // namespace

std::string json_quoted(const std::string& s) {
  std::string q = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') q += '\\';
    if (ch == '\n') {
      q += "\\n";
      continue;
    }
    q += ch;
  }
  return q + "\"";
}

const CpuIdentity& this_cpu() {
  static const CpuIdentity id = probe_identity();
  return id;
}

std::string profile_path() {
  if (const char* p = std::getenv("CIM_INT4_PROFILE"); p != nullptr && p[0] != '\0') return p;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && x[0] == '/') {
    return std::string(x) + "/cim-int4/kernel-profile.json";
  }
  if (const char* h = std::getenv("HOME"); h != nullptr && h[0] == '/') {
    return std::string(h) + "/.cache/cim-int4/kernel-profile.json";
  }
  return "";
}

std::string save_choice(const std::string& path, const TuneReport& report) {
  if (path.empty()) return "no profile path (set CIM_INT4_PROFILE or HOME)";
  Entries entries;
  if (std::string problem = read_profile(path, entries); !problem.empty()) {
    return "not overwriting " + path + " (" + problem + ")";
  }
  entries["format"] = kFormat;
  entries[this_cpu().key + "/cpu"] = this_cpu().name;
  for (Mode mode : {kFp32, kInt8}) entries[entry(report.table, mode)] = report.rows[report.chosen[mode]].name;
  if (std::string e = make_dirs(path); !e.empty()) return e;
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << "{\n";
    size_t i = 0;
    for (const auto& [k, v] : entries) f << "  " << json_quoted(k) << ": " << json_quoted(v) << (++i < entries.size() ? ",\n" : "\n");
    f << "}\n";
    if (!f.flush()) return "cannot write " + tmp;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    return "cannot replace " + path + ": " + why;
  }
  return "";
}

bool choose_variants(const KernelTable& table, VariantChoice& choice, std::string& error) {
  VariantChoice c;
  for (Mode mode : {kFp32, kInt8}) c.variant[mode] = &table.default_variant(mode);
  c.source = "defaults";
  // Read at every kernel creation, as CIM_INT4_KERNEL is: tests force each variant in turn.
  const char* forced = std::getenv("CIM_INT4_VARIANT");
  if (forced != nullptr && forced[0] != '\0' && std::strcmp(forced, "auto") != 0) {
    const KernelVariant* v = table.find_variant(forced);
    if (v == nullptr) {
      error = std::string("CIM_INT4_VARIANT=") + forced + " is not a variant of the " + table.name +
              " kernels; available: " + variant_names(table) + " (or auto)";
      return false;
    }
    c.variant[kFp32] = c.variant[kInt8] = v;
    c.source = "CIM_INT4_VARIANT";
    choice = c;
    return true;
  }
  if (table.variant_count < 2) {
    choice = c;
    return true;
  }
  // The profile is read (and a tuning run) once per table and profile path in a process.
  static std::mutex mutex;
  static std::map<std::string, VariantChoice> decided;
  const std::string path = profile_path();
  const std::string memo_key = std::string(table.name) + "|" + path;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = decided.find(memo_key); it != decided.end()) {
    choice = it->second;
    choice.message.clear();  // said once per process
    return true;
  }
  bool found = false;
  if (!path.empty()) {
    c.message = from_profile(table, path, c, found);
    if (found) c.source = "profile " + path;
  }
  if (!found && tuning_enabled()) {
    const TuneReport r = tune(table, TuneOptions{});
    for (Mode mode : {kFp32, kInt8}) c.variant[mode] = &table.variants[r.chosen[mode]];
    c.source = "tuned";
    const std::string saved = save_choice(path, r);
    char line[512];
    std::snprintf(line, sizeof line, "cim-int4: tuned the %s kernels for this CPU in %.2f s (fp32: %s, int8: %s); %s%s",
                  table.name, r.setup_seconds + r.elapsed_seconds, c.variant[kFp32]->name, c.variant[kInt8]->name,
                  saved.empty() ? "saved to " : "not saved: ", saved.empty() ? path.c_str() : saved.c_str());
    c.message = line;
  }
  decided[memo_key] = c;
  choice = c;
  return true;
}

}  // namespace cim
