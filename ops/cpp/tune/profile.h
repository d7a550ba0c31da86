// Which decode variant (kernels/variants.h) each compute mode runs on this CPU: forced by
// CIM_INT4_VARIANT, else read from the per-CPU profile, else tuned now (tuner.h) and
// saved there, else the table's defaults. No ORT: the op calls choose_variants() when it
// creates a kernel; `cim-int4 tune` (tune_api.cpp) writes the profile explicitly.
//
// The profile is one flat JSON object of strings, shared by every CPU that uses the file
// (a home folder on a cluster of different machines, say):
//   {"format": "cim-int4 kernel profile 1",
//    "<cpu key>/cpu": "AMD EPYC 9R14 (AuthenticAMD family 25 model 17)",
//    "<cpu key>/avx512_vnni/fp32": "t4-pf12k", "<cpu key>/avx512_vnni/int8": "t4-nopf", ...}
// The CPU key names vendor, family, model, the instruction sets the kernels use and the
// variant grid's version, so a new CPU, a new VM flag set or a new grid tunes afresh.
// Its path: $CIM_INT4_PROFILE, else $XDG_CACHE_HOME/cim-int4/kernel-profile.json, else
// ~/.cache/cim-int4/kernel-profile.json.
#pragma once

#include <string>

#include "kernels/kernel.h"
#include "tune/tuner.h"

namespace cim {

struct CpuIdentity {
  std::string key;   // e.g. "AuthenticAMD-26-2-avx2.avx512.avx512vnni.avxvnni-g2"
  std::string name;  // brand string with vendor, family and model
};
const CpuIdentity& this_cpu();

// The profile's path ("" when there is no home folder to keep it in).
std::string profile_path();

struct VariantChoice {
  const KernelVariant* variant[2] = {nullptr, nullptr};  // per Mode
  std::string source;   // "CIM_INT4_VARIANT", "profile <path>", "tuned", "defaults"
  std::string message;  // one line for stderr, set on the first choice per table and
                        // profile in a process when there is something to say (a bad
                        // profile, a tuning)
};

// The variants for `table`: CIM_INT4_VARIANT (read at every call), else the profile's
// entry or a tuning (decided once per table and profile path, then remembered). Returns false with `error` set (one line) when CIM_INT4_VARIANT names no variant of the table.
// Implicit tuning runs only when the profile has no entry for this CPU and table, the
// table has more than one variant and CIM_INT4_TUNE is not "off"; it takes
// TuneOptions{}.budget_seconds (up to kTuneExtendFactor times it while the choice is open)
// plus the set-up of a stream twice the last-level cache.
bool choose_variants(const KernelTable& table, VariantChoice& choice, std::string& error);

// Saves a tuning's choice for this CPU into the profile at `path` (other entries kept;
// written to a temporary file, then renamed). Returns "" or what went wrong (one line).
std::string save_choice(const std::string& path, const TuneReport& report);

// `s` as a JSON string literal (quotes and backslashes escaped, newlines as \n).
std::string json_quoted(const std::string& s);

}  // namespace cim
