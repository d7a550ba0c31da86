// Kernel test: every kernel table this CPU runs, over many shapes, in both compute
// modes, every code width and both scale dtypes, against a float64 reference of the
// attribute format (the test packs its own bit streams and float16 scales) and the
// portable oracle.
//
// Every buffer a kernel touches ends against a PROT_NONE page: A's last row ends at K,
// the weight stream at its last block, the bias at its last (padded) entry, int8 A at
// its last group and Y's last row at N. A SIMD read of A past K or a write past Y
// faults instead of passing. (Shapes with a_pad, added to start A off a 64-byte line,
// leave a few floats between A and its guard page.)
//
// Checked per table and shape:
//   accuracy  portable fp32: |y - exact| <= (K + 2) 2^-24 sum_k |a_k w_k| (+ the bias rounding)
//             portable int8: within that plus sum_g (amax_g / 254) sum_{k in g} |w_k| (A's rounding)
//   oracle    every table and every one of its decode variants (variants.h) gives the same
//             bits as the portable kernel, in both modes (4-bit codes: every variant; other
//             widths: the table's width kernel, on an eighth of the shapes each)
//   float16   half_to_float against the compiler's _Float16 conversion, all 65536 values
//   split     the same bits whatever ranges of tiles the channels come in
//   batch     the same bits for row m of A alone (M = 1) as within the batch
//   bounds    Y entries between N and ldy are left untouched
//
// Usage: kernel_test        (exit status 0 when every check passes)
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cim_int4_contract.h"
#include "kernels/gather.h"
#include "kernels/kernel.h"
#include "kernels/repack.h"

namespace {

// What is running, for the message when a guard page fault kills the test.
char g_running[256] = "setup";

void report_fault(int) {
  const char head[] = "FAULT (read or write past a buffer) in: ";
  ssize_t ignored = write(STDOUT_FILENO, head, sizeof head - 1);
  ignored = write(STDOUT_FILENO, g_running, std::strlen(g_running));
  ignored = write(STDOUT_FILENO, "\n", 1);
  (void)ignored;
  _exit(1);
}

// `bytes` of memory whose last byte is followed by an inaccessible page.
class GuardedBuffer {
 public:
  explicit GuardedBuffer(size_t bytes) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t data_pages = (bytes + page - 1) / page;
    map_bytes_ = (data_pages + 1) * page;
    void* p = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("mmap");
      std::exit(2);
    }
    map_ = static_cast<uint8_t*>(p);
    uint8_t* guard = map_ + data_pages * page;
    if (mprotect(guard, page, PROT_NONE) != 0) {
      std::perror("mprotect");
      std::exit(2);
    }
    data_ = guard - bytes;
  }
  ~GuardedBuffer() { munmap(map_, map_bytes_); }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(data_);
  }

 private:
  uint8_t* map_ = nullptr;
  size_t map_bytes_ = 0;
  uint8_t* data_ = nullptr;
};

constexpr const char* kScaleNames[] = {"f32", "f16", "i8"};

struct Shape {
  int64_t M, N, K, group_size;
  int bits = 4;
  int grid = 0;  // what a code stands for: 0 uniform, 1 normal (contract::kGrids)
  int scale_type = cim::kScaleF32;  // float32, float16 or int8 scales (kernel.h's ScaleType)
  int64_t lda, ldy;
  bool bias;
  bool wide_range;  // activations spread over many binades, to stress the bound
  // Every code at its largest, every activation of a row +1 or -1 (int8 mode: q = +-127):
  // the largest integer sums, where an int16 pair sum flushed too late would saturate.
  bool extreme = false;
  // Floats between A's last row and its guard page (0: none), to start A off a 64-byte
  // line when K is a multiple of 16.
  int64_t a_pad = 0;
};

// The q a code stands for, from the contract's tables (not the library's CodeLevels).
int level_of(int64_t bits, int grid, int code) {
  if (grid == 0) return code - (1 << (bits - 1));
  return bits == 2 ? cim::contract::kNormalLevels2[code] : cim::contract::kNormalLevels3[code];
}

std::string describe(const Shape& s) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "bits=%d%s scales=%s M=%" PRId64 " N=%" PRId64 " K=%" PRId64 " group=%" PRId64
                " lda=%" PRId64 " ldy=%" PRId64 " bias=%d wide=%d a_pad=%" PRId64 " extreme=%d",
                s.bits, s.grid ? " grid=normal" : "", kScaleNames[s.scale_type], s.M, s.N, s.K, s.group_size, s.lda, s.ldy, int(s.bias),
                int(s.wide_range), s.a_pad, int(s.extreme));
  return buf;
}

// One shape's inputs: the attribute-format weights, their float64 meaning, and guarded
// copies of everything a kernel reads.
class Problem {
 public:
  Problem(const Shape& s, std::mt19937_64& rng)
      : s_(s),
        groups_((s.K + s.group_size - 1) / s.group_size),
        k_padded_(groups_ * s.group_size),
        codes_(static_cast<size_t>(s.N * s.K)),
        scales_(static_cast<size_t>(s.N * groups_)),
        half_scales_(s.scale_type == cim::kScaleF16 ? static_cast<size_t>(s.N * groups_) : 0),
        int8_scales_(s.scale_type == cim::kScaleI8 ? static_cast<size_t>(s.N * groups_) : 0),
        supers_(cim::supers_of(groups_)),
        super_scales_(s.scale_type == cim::kScaleI8 ? static_cast<size_t>(s.N * supers_) : 0),
        bias_(s.bias ? static_cast<size_t>(s.N) : 0),
        a_(static_cast<size_t>((s.M - 1) * s.lda + s.K)) {
    std::uniform_int_distribution<int> code(0, (1 << s.bits) - 1);
    const int offset = 1 << (s.bits - 1);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::uniform_int_distribution<int> binade(-20, 20);
    for (auto& c : codes_) c = static_cast<uint8_t>(code(rng));
    for (size_t i = 0; i < scales_.size(); ++i) {
      scales_[i] = (i % 7 == 3) ? 0.0f : 0.01f + 0.5f * std::fabs(uniform(rng));
      if (s.scale_type == cim::kScaleF16) {  // a float16 value (sometimes subnormal, sometimes negative): its bits, and it as float32
        _Float16 h = static_cast<_Float16>(i % 11 == 5 ? scales_[i] * 1e-5f : scales_[i]);
        if (i % 5 == 2) h = -h;
        std::memcpy(&half_scales_[i], &h, sizeof h);
        scales_[i] = static_cast<float>(h);
      }
    }
    if (s.scale_type == cim::kScaleI8) {
      // Super-scales: float16 values, some subnormal, some negative, some zero; int8 scales
      // over the whole range, -128 included. The scale is q * (d / 128), exact in float32.
      std::uniform_int_distribution<int> q8(-128, 127);
      for (size_t b = 0; b < super_scales_.size(); ++b) {
        const float d = b % 13 == 6 ? 0.0f : (b % 11 == 5 ? 1e-5f : 1.0f) * (0.0001f + 0.004f * std::fabs(uniform(rng)));
        _Float16 h = static_cast<_Float16>(b % 5 == 2 ? -d : d);
        std::memcpy(&super_scales_[b], &h, sizeof h);
      }
      for (int64_t n = 0; n < s.N; ++n) {
        for (int64_t g = 0; g < groups_; ++g) {
          const size_t i = static_cast<size_t>(n * groups_ + g);
          int8_scales_[i] = static_cast<int8_t>(i % 7 == 3 ? 0 : q8(rng));
          _Float16 h;
          std::memcpy(&h, &super_scales_[n * supers_ + g / cim::kSuperGroups], sizeof h);
          scales_[i] = static_cast<float>(int8_scales_[i]) * (static_cast<float>(h) / cim::kInt8ScaleOne);
        }
      }
    }
    for (auto& b : bias_) b = 4.0f * uniform(rng);
    for (auto& a : a_) a = s.wide_range ? std::ldexp(uniform(rng), binade(rng)) : uniform(rng);
    if (s.extreme) {
      for (auto& c : codes_) c = static_cast<uint8_t>((1 << s.bits) - 1);
      for (int64_t m = 0; m < s.M; ++m) {
        for (int64_t k = 0; k < s.K; ++k) a_[m * s.lda + k] = m % 2 ? -1.0f : 1.0f;
      }
    }
    // Special groups for int8 mode's quantization of A: all zero, and so tiny (below
    // 127 / FLT_MAX) that the group counts as zero.
    for (int64_t m = 0; m < s.M && !s.extreme; ++m) {
      const int64_t g = m % groups_;
      const int64_t end = std::min(s.K, (g + 1) * s.group_size);
      for (int64_t k = g * s.group_size; k < end; ++k) {
        if (m % 5 == 1) a_[m * s.lda + k] = 0.0f;
        if (m % 5 == 3) a_[m * s.lda + k] = std::ldexp(uniform(rng), -125);
      }
    }

    // Attribute layout: row n one little-endian bit stream, element k in bits k*bits ..
    // k*bits + bits-1 (for 4 bits: byte k / 2, even k in the low nibble); padding past K
    // is the code of q = 0.
    const int64_t row_bytes = k_padded_ * s.bits / 8;
    std::vector<uint8_t> packed(static_cast<size_t>(s.N * row_bytes), 0);
    for (int64_t n = 0; n < s.N; ++n) {
      for (int64_t k = 0; k < k_padded_; ++k) {
        const uint32_t c = k < s.K ? codes_[n * s.K + k] : uint32_t(offset);
        for (int bit = 0; bit < s.bits; ++bit) {
          const int64_t at = k * s.bits + bit;
          packed[n * row_bytes + at / 8] |= static_cast<uint8_t>(((c >> bit) & 1) << (at % 8));
        }
      }
    }
    const void* scales = s.scale_type == cim::kScaleF16  ? static_cast<const void*>(half_scales_.data())
                         : s.scale_type == cim::kScaleI8 ? static_cast<const void*>(int8_scales_.data())
                                                         : scales_.data();
    const std::string err =
        storage_.build(s.K, s.N, s.group_size, s.bits, packed.data(), scales, s.scale_type,
                       s.scale_type == cim::kScaleI8 ? super_scales_.data() : nullptr, s.bias ? bias_.data() : nullptr,
                       s.grid);
    if (!err.empty()) {
      std::fprintf(stderr, "repack failed for %s: %s\n", describe(s).c_str(), err.c_str());
      std::exit(2);
    }

    // Guarded copies: the stream ends at its last block, the bias at tiles * 16.
    const cim::PackedWeights& src = storage_.weights();
    const size_t stream_bytes = static_cast<size_t>(src.tiles * src.strip_bytes_per_tile());
    stream_ = std::make_unique<GuardedBuffer>(stream_bytes);
    std::memcpy(stream_->as<uint8_t>(), src.stream, stream_bytes);
    if (s.bias) {
      bias_g_ = std::make_unique<GuardedBuffer>(static_cast<size_t>(src.tiles * cim::kTileN) * sizeof(float));
      std::memcpy(bias_g_->as<float>(), src.bias, static_cast<size_t>(src.tiles * cim::kTileN) * sizeof(float));
    }
    a_g_ = std::make_unique<GuardedBuffer>((a_.size() + static_cast<size_t>(s.a_pad)) * sizeof(float));
    std::memcpy(a_g_->as<float>(), a_.data(), a_.size() * sizeof(float));

    w_ = src;
    w_.stream = stream_->as<uint8_t>();
    w_.bias = s.bias ? bias_g_->as<float>() : nullptr;

    // int8 mode's A, quantized by the portable routine that every table shares.
    const size_t q_bytes = static_cast<size_t>(s.M * k_padded_);
    const size_t per_group = static_cast<size_t>(s.M * groups_);
    q_g_ = std::make_unique<GuardedBuffer>(q_bytes);
    qscale_g_ = std::make_unique<GuardedBuffer>(per_group * sizeof(float));
    qsum_g_ = std::make_unique<GuardedBuffer>(per_group * sizeof(int32_t));
    cim::quantize_a_portable(a_g_->as<float>(), s.M, s.lda, s.K, s.group_size, q_g_->as<int8_t>(),
                             qscale_g_->as<float>(), qsum_g_->as<int32_t>());
    qa_.q = q_g_->as<int8_t>();
    qa_.scale = qscale_g_->as<float>();
    qa_.qsum = qsum_g_->as<int32_t>();
  }

  // Whether `table`'s quantization of A gives the same bytes as the portable one.
  bool quantize_matches(const cim::KernelTable& table) {
    std::vector<int8_t> q(static_cast<size_t>(s_.M * k_padded_), 0x55);
    std::vector<float> scale(static_cast<size_t>(s_.M * groups_));
    std::vector<int32_t> qsum(scale.size());
    table.quantize_a(a_g_->as<float>(), s_.M, s_.lda, s_.K, s_.group_size, q.data(), scale.data(), qsum.data());
    return std::memcmp(q.data(), qa_.q, q.size()) == 0 &&
           std::memcmp(scale.data(), qa_.scale, scale.size() * sizeof(float)) == 0 &&
           std::memcmp(qsum.data(), qa_.qsum, qsum.size() * sizeof(int32_t)) == 0;
  }

  // The quantized A of rows m .. M-1 (for M = 1 calls on row m alone).
  cim::QuantizedA qa_from(int64_t m) const {
    cim::QuantizedA q = qa_;
    q.q += m * k_padded_;
    q.scale += m * groups_;
    q.qsum += m * groups_;
    return q;
  }

  const Shape& shape() const { return s_; }
  const cim::PackedWeights& weights() const { return w_; }
  const float* a() { return a_g_->as<float>(); }

  // Exact y[m, n] and the bound on its float32 error.
  // With int8, the bound adds A's rounding: |a - q * amax / 127| <= amax / 254 per element.
  void reference(int64_t m, int64_t n, bool int8, double& exact, double& bound) const {
    double sum = 0.0, abs_sum = 0.0, a_rounding = 0.0;
    for (int64_t g = 0; g < groups_; ++g) {
      double amax = 0.0, abs_w = 0.0;
      for (int64_t k = g * s_.group_size; k < std::min(s_.K, (g + 1) * s_.group_size); ++k) {
        const double w = level_of(s_.bits, s_.grid, codes_[n * s_.K + k]) * double(scales_[n * groups_ + g]);
        const double t = double(a_[m * s_.lda + k]) * w;
        sum += t;
        abs_sum += std::fabs(t);
        amax = std::max(amax, std::fabs(double(a_[m * s_.lda + k])));
        abs_w += std::fabs(w);
      }
      // A group whose 127 / amax overflows counts as zero (documented with int8 mode).
      a_rounding += (amax > 0 && 127.0 / amax > 3.4028234663852886e38 ? amax : amax / 254.0) * abs_w;
    }
    const double u = std::ldexp(1.0, -24);
    // Results in the subnormal range also round to absolute steps of 2^-149 per operation.
    bound = double(s_.K + 2) * u * (abs_sum + (int8 ? a_rounding : 0.0)) + (int8 ? a_rounding * (1 + 1e-6) : 0.0) +
            double(2 * s_.K + 2) * std::ldexp(1.0, -149);
    exact = sum;
    if (s_.bias) {
      exact += bias_[n];
      bound += u * (std::fabs(exact) + bound);
    }
  }

 private:
  Shape s_;
  int64_t groups_, k_padded_;
  std::vector<uint8_t> codes_;  // [N, K], 0 .. 2^bits - 1
  std::vector<float> scales_;   // [N, groups] (float16 values when f16)
  std::vector<uint16_t> half_scales_;  // [N, groups]: their float16 bits, when float16
  std::vector<int8_t> int8_scales_;    // [N, groups]: the int8 scales, when int8
  int64_t supers_;
  std::vector<uint16_t> super_scales_;  // [N, supers]: their float16 super-scales' bits, when int8
  std::vector<float> bias_;     // [N] or empty
  std::vector<float> a_;        // [M, lda], only the first K of each row used
  cim::PackedStorage storage_;
  std::unique_ptr<GuardedBuffer> stream_, bias_g_, a_g_, q_g_, qscale_g_, qsum_g_;
  cim::PackedWeights w_;
  cim::QuantizedA qa_;
};

// Y[M, ldy] against a guard page; the columns past N hold a sentinel that must survive.
class Output {
 public:
  explicit Output(const Shape& s) : s_(s), buf_(static_cast<size_t>((s.M - 1) * s.ldy + s.N) * sizeof(float)) {
    float* y = buf_.as<float>();
    for (int64_t i = 0; i < (s.M - 1) * s.ldy + s.N; ++i) y[i] = kSentinel;
  }
  float* data() { return buf_.as<float>(); }
  float at(int64_t m, int64_t n) { return data()[m * s_.ldy + n]; }
  bool padding_untouched() {
    for (int64_t m = 0; m + 1 < s_.M; ++m) {
      for (int64_t n = s_.N; n < s_.ldy; ++n) {
        if (std::memcmp(&data()[m * s_.ldy + n], &kSentinel, sizeof(float)) != 0) return false;
      }
    }
    return true;
  }

 private:
  static constexpr float kSentinel = -12345.678f;
  Shape s_;
  GuardedBuffer buf_;
};

struct Tally {
  int64_t cases = 0, failures = 0;
  double worst_ratio = 0.0;  // max |y - exact| / bound seen
};

bool same_bits(float x, float y) { return std::memcmp(&x, &y, sizeof x) == 0; }

struct Mode {
  const char* name;
  bool int8;
};
constexpr Mode kModes[] = {{"fp32", false}, {"int8", true}};

// The op's split of a layer (kernel.h): whole strips, every call but the last of one span.
static_assert(cim::range_span(37, 2) == 20, "37 tiles (10 strips) in 2 calls: 5 strips each");
static_assert(cim::range_span(37, 3) == 16, "10 strips in 3 calls: 4, 4 and 2");
static_assert(cim::range_span(5, 8) == 4, "2 strips in at most 8 calls: a strip a call");
static_assert(cim::range_span(256, 1) == 256, "one call takes the whole layer");

// Runs rows [m, m + M) of the problem through one variant's kernel of `mode`, tiles [t0, t1).
void run(const cim::KernelVariant& variant, const Mode& mode, Problem& p, int64_t m, int64_t M, float* y, int64_t t0,
         int64_t t1) {
  const cim::QuantizedA qa = p.qa_from(m);
  cim::MatMulArgs args;
  args.A = p.a() + m * p.shape().lda;
  args.M = M;
  args.lda = p.shape().lda;
  args.Y = y;
  args.ldy = p.shape().ldy;
  args.W = &p.weights();
  args.QA = &qa;
  variant.matmul[mode.int8 ? cim::kInt8 : cim::kFp32](args, t0, t1);
}

// The portable kernel's output against float64: the accuracy of the arithmetic itself.
bool check_accuracy(const Mode& mode, Problem& p, Output& oracle, Tally& tally) {
  const Shape& s = p.shape();
  for (int64_t m = 0; m < s.M; ++m) {
    for (int64_t n = 0; n < s.N; ++n) {
      double exact, bound;
      p.reference(m, n, mode.int8, exact, bound);
      const double err = std::fabs(double(oracle.at(m, n)) - exact);
      if (!(err <= bound)) {
        std::printf("FAIL portable %s %s: y[%" PRId64 ",%" PRId64 "] = %.9g, exact %.9g, error %.3g > bound %.3g\n",
                    mode.name, describe(s).c_str(), m, n, double(oracle.at(m, n)), exact, err, bound);
        return false;
      }
      if (bound > 0) tally.worst_ratio = std::fmax(tally.worst_ratio, err / bound);
    }
  }
  return true;
}

// One variant of a table in one mode: the same bits as the portable oracle, whatever the
// tile split and with each row of A alone; nothing written past N. Prints why and returns false.
// Variants differ only at M = 1 (their M > 1 path is the table's one prefill), so with
// `decode_only` a shape with M > 1 checks its rows alone and skips the whole and split calls.
bool check_variant(const cim::KernelTable& table, const cim::KernelVariant& variant, const Mode& mode, Problem& p,
                   Output& oracle, std::mt19937_64& rng, bool decode_only) {
  const Shape& s = p.shape();
  const int64_t tiles = p.weights().tiles;
  const std::string where = std::string(table.name) + " " + variant.name + " " + mode.name + " " + describe(s);
  std::snprintf(g_running, sizeof g_running, "%s", where.c_str());

  if (mode.int8 && !p.quantize_matches(table)) {
    std::printf("FAIL %s: quantize_a differs from the portable one\n", where.c_str());
    return false;
  }
  Output whole(s), split(s), rows(s);
  const bool batch = !(decode_only && s.M > 1);
  if (batch) {
    run(variant, mode, p, 0, s.M, whole.data(), 0, tiles);
    std::uniform_int_distribution<int64_t> step(1, 6);
    for (int64_t t0 = 0; t0 < tiles;) {
      const int64_t t1 = std::min(tiles, t0 + step(rng));
      run(variant, mode, p, 0, s.M, split.data(), t0, t1);
      t0 = t1;
    }
  }
  for (int64_t m = 0; m < s.M; ++m) run(variant, mode, p, m, 1, rows.data() + m * s.ldy, 0, tiles);

  struct Against {
    const char* what;
    Output* out;
  };
  for (const Against& c : {Against{"the whole call", &whole}, Against{"a split call", &split},
                           Against{"rows alone (M=1)", &rows}}) {
    if (!batch && c.out != &rows) continue;
    if (!c.out->padding_untouched()) {
      std::printf("FAIL %s: %s wrote Y between N and ldy\n", where.c_str(), c.what);
      return false;
    }
    for (int64_t m = 0; m < s.M; ++m) {
      for (int64_t n = 0; n < s.N; ++n) {
        if (!same_bits(c.out->at(m, n), oracle.at(m, n))) {
          std::printf("FAIL %s: y[%" PRId64 ",%" PRId64 "] = %.9g from %s, portable gives %.9g\n", where.c_str(), m, n,
                      double(c.out->at(m, n)), c.what, double(oracle.at(m, n)));
          return false;
        }
      }
    }
  }
  return true;
}

std::vector<Shape> shapes() {
  // Around every unit and group boundary, plus a few long rows.
  const int64_t ks[] = {1,   2,   3,   5,   7,   8,   9,   15,  16,  17,  24,  31,   32,   33,   40,  47,
                        48,  49,  63,  64,  65,  96,  100, 127, 128, 129, 200, 255,  256,  257,  300, 383,
                        384, 385, 511, 512, 513, 640, 777, 1000, 1024, 1031, 2048, 4096, 4099};
  // (M, N) pairs covering every remainder of the register blocks: N around tiles of 16
  // and the 4-tile decode block (64) and the 2-tile prefill chunk (32); M around the
  // prefill row blocks (6 for AVX-512; 6 in fp32 mode and, in int8 mode, 4 with AVX-VNNI or
  // 3 of 2 tiles without it for AVX2) and the
  // benchmark's M = 1, 16 and 128.
  // (N = 200: 13 tiles, a pair of strips that the n4x2 variants run together, a strip and a
  // tile alone; N = 600: 38 tiles, short strips paired across a window of 8, a ninth strip
  // and two tiles alone: tile_kernels.h's strip_pairs.)
  const int64_t mn[][2] = {{1, 1},  {1, 15}, {1, 16},  {1, 17},  {1, 64}, {1, 77}, {1, 200}, {1, 600}, {2, 3},
                           {2, 33}, {5, 9},  {7, 48},  {7, 50},  {16, 31}, {6, 37}, {13, 20}, {33, 19}};
  std::vector<Shape> out;
  int64_t i = 0;
  for (int64_t g : cim::contract::kGroupSizes) {
    for (int64_t k : ks) {
      for (const auto& p : mn) {
        Shape s;
        s.M = p[0];
        s.N = p[1];
        s.K = k;
        s.group_size = g;
        s.lda = k + (i % 3 == 1 ? 5 : 0);
        s.ldy = s.N + (i % 4 == 2 ? 3 : 0);
        s.bias = i % 2 == 1;
        s.wide_range = i % 5 == 4;
        out.push_back(s);
        ++i;
      }
    }
  }
  // Long prefill, row-major and contiguous unless lda_pad > 0.
  auto long_shape = [&](int64_t m, int64_t n, int64_t k, int64_t g, int64_t lda_pad, bool bias, bool wide) {
    Shape s;
    s.M = m;
    s.N = n;
    s.K = k;
    s.group_size = g;
    s.lda = k + lda_pad;
    s.ldy = n;
    s.bias = bias;
    s.wide_range = wide;
    out.push_back(s);
  };
  // fp32 prefill by panel (panel_kernels.h, AVX2 and AVX-512): more rows than one packed
  // block of A (192), so more than one first block of rows (which makes the panels on
  // AVX-512), tiles past one chunk (2 tiles on AVX-512, 4 on AVX2) with a partial last one,
  // K past one panel of 512 inputs with a tail (a partial last group).
  for (int64_t g : {16, 32, 256}) {
    for (int64_t k : {513, 1031}) {
      for (int64_t m : {200, 385}) long_shape(m, 100, k, g, m == 200 ? 3 : 0, k == 513, g == 16);
    }
  }
  // The same for groups 64 and 128, with a last block of 4 rows (28 = 6 * 4 + 4; 196 = two
  // packed blocks of 102 and 94 rows).
  for (int64_t g : {64, 128}) {
    for (int64_t m : {28, 196}) long_shape(m, 100, 1031, g, 0, m == 28, false);
  }
  // AVX-512 takes a panel's tiles two at a time: a partial last tile inside a pair (N = 120:
  // tiles 6-7, the last one of 8 channels) and one left alone (N = 100: tile 6).
  for (int64_t m : {30, 200}) long_shape(m, 120, 1031, 32, 0, m == 30, m == 200);
  // M = 128 and 129 for a few K.
  for (int64_t g : {32, 128}) {
    for (int64_t k : {100, 512}) {
      for (int64_t m : {128, 129}) long_shape(m, 35, k, g, 0, m == 129, false);
    }
  }
  // Rows of A that start off a 64-byte line by the same amount (lda a multiple of 16),
  // as NumPy arrays often do: the AVX-512 prefill then shifts its chunks of K to A's
  // lines. When K is not a multiple of 16 the last row still ends at the guard page.
  const int64_t misaligned_mn[][2] = {{10, 17}, {31, 16}, {83, 19}};
  for (int64_t g : {16, 32, 128}) {
    for (int64_t k : ks) {
      for (const auto& p : misaligned_mn) {
        Shape s;
        s.M = p[0];
        s.N = p[1];
        s.K = k;
        s.group_size = g;
        s.lda = (k + 15) / 16 * 16 + (i % 2) * 16;
        s.ldy = s.N + (i % 4 == 2 ? 3 : 0);
        s.bias = i % 2 == 1;
        s.wide_range = i % 5 == 4;
        s.a_pad = k % 16 == 0 ? 1 + i % 15 : 0;
        out.push_back(s);
        ++i;
      }
    }
  }
  // The largest integer sums, per group size and M = 1 (decode) and 3 (prefill), with K
  // past several groups and N past a strip (and past a pair of strips at M = 1); every width below.
  for (int64_t g : cim::contract::kGroupSizes) {
    for (const auto& mn_pair : {std::array<int64_t, 2>{1, 77}, {3, 77}, {1, 200}}) {
      Shape s;
      s.M = mn_pair[0];
      s.N = mn_pair[1];
      s.K = 4 * g + 3;
      s.group_size = g;
      s.lda = s.K;
      s.ldy = s.N;
      s.bias = false;
      s.wide_range = false;
      s.extreme = true;
      out.push_back(s);
    }
  }
  // Every other width and scale dtype on an eighth of those shapes (a different eighth each,
  // so that the sanitizer stage of CI stays within minutes), and on every extreme shape.
  const size_t base = out.size();
  int64_t combo = 0;
  for (int64_t bits : cim::contract::kBits) {
    for (int scale_type : {cim::kScaleF32, cim::kScaleF16, cim::kScaleI8}) {
      if (bits == 4 && scale_type == cim::kScaleF32) continue;
      for (size_t j = 0; j < base; ++j) {
        if (j % 8 != static_cast<size_t>(combo % 8) && !out[j].extreme) continue;
        Shape s = out[j];
        s.bits = static_cast<int>(bits);
        s.scale_type = scale_type;
        out.push_back(s);
      }
      ++combo;
    }
  }
  // The non-uniform grid of each width that has one, every scale dtype, the same way.
  for (int64_t bits : cim::contract::kGridBits) {
    for (int scale_type : {cim::kScaleF32, cim::kScaleF16, cim::kScaleI8}) {
      for (size_t j = 0; j < base; ++j) {
        if (j % 8 != static_cast<size_t>(combo % 8) && !out[j].extreme) continue;
        Shape s = out[j];
        s.bits = static_cast<int>(bits);
        s.grid = 1;
        s.scale_type = scale_type;
        out.push_back(s);
      }
      ++combo;
    }
  }
  return out;
}

}  // namespace

// gather_rows against the format's definition, one float32 product per element, for
// every width and scale dtype, with the codes, the scales and the output each ending at a
// guard page (the last row of the table is always gathered).
int64_t check_gather(std::mt19937_64& rng) {
  int64_t failures = 0;
  const int64_t rows = 37;
  for (int64_t bits : cim::contract::kBits) {
   for (int grid = 0; grid < 2; ++grid) {
    const bool has_grid = std::find(std::begin(cim::contract::kGridBits), std::end(cim::contract::kGridBits), bits) !=
                          std::end(cim::contract::kGridBits);
    if (grid != 0 && !has_grid) continue;
    for (int scale_type : {cim::kScaleF32, cim::kScaleF16, cim::kScaleI8}) {
      for (int64_t group_size : cim::contract::kGroupSizes) {
        for (int64_t K : {int64_t(1), group_size - 1, group_size, group_size + 1, 3 * group_size + 7, int64_t(640),
                          int64_t(9) * group_size}) {
          const int64_t groups = (K + group_size - 1) / group_size;
          const int64_t supers = cim::supers_of(groups);
          const int64_t row_bytes = groups * group_size * bits / 8;
          const size_t scale_size = static_cast<size_t>(cim::scale_size_of(scale_type));
          GuardedBuffer codes(static_cast<size_t>(rows * row_bytes));
          GuardedBuffer scales(static_cast<size_t>(rows * groups) * scale_size);
          GuardedBuffer super(scale_type == cim::kScaleI8 ? static_cast<size_t>(rows * supers) * 2 : 2);
          for (int64_t i = 0; i < rows * row_bytes; ++i) codes.as<uint8_t>()[i] = static_cast<uint8_t>(rng());
          std::normal_distribution<float> normal(0.0f, 0.05f);
          std::vector<float> scale_values(static_cast<size_t>(rows * groups));
          for (int64_t i = 0; i < rows * supers && scale_type == cim::kScaleI8; ++i) {
            const _Float16 h = static_cast<_Float16>(normal(rng) / 64.0f);
            std::memcpy(super.as<uint8_t>() + 2 * i, &h, 2);
          }
          for (int64_t i = 0; i < rows * groups; ++i) {
            scale_values[i] = normal(rng);
            if (scale_type == cim::kScaleI8) {
              const auto q = static_cast<int8_t>(rng());
              _Float16 h;
              std::memcpy(&h, super.as<uint8_t>() + 2 * (i / groups * supers + i % groups / cim::kSuperGroups), 2);
              std::memcpy(scales.as<uint8_t>() + i, &q, 1);
              scale_values[i] = static_cast<float>(q) * (static_cast<float>(h) / cim::kInt8ScaleOne);
            } else if (scale_type == cim::kScaleF16) {
              const _Float16 h = static_cast<_Float16>(scale_values[i]);
              std::memcpy(scales.as<uint8_t>() + 2 * i, &h, 2);
              scale_values[i] = static_cast<float>(h);
            } else {
              std::memcpy(scales.as<uint8_t>() + 4 * i, &scale_values[i], 4);
            }
          }
          const std::vector<int64_t> picks = {rows - 1, 0, 5, rows - 1, 17};
          const int64_t count = static_cast<int64_t>(picks.size());
          GuardedBuffer out(static_cast<size_t>(count * K) * sizeof(float));
          cim::Int4Table t;
          t.packed = codes.as<uint8_t>();
          t.scales = scales.as<uint8_t>();
          t.scale_type = scale_type;
          t.super_scales = scale_type == cim::kScaleI8 ? super.as<uint16_t>() : nullptr;
          t.bits = static_cast<int>(bits);
          if (!cim::make_levels(t.bits, grid, &t.levels)) {
            std::printf("FAIL make_levels bits=%d grid=%d\n", t.bits, grid);
            ++failures;
          }
          t.rows = rows;
          t.K = K;
          t.group_size = group_size;
          t.groups = groups;
          std::snprintf(g_running, sizeof g_running,
                        "gather_rows bits=%d grid=%d scales=%s K=%" PRId64 " group_size=%" PRId64, int(bits), grid,
                        kScaleNames[scale_type], K, group_size);
          cim::gather_rows(t, picks.data(), 0, count, out.as<float>());
          for (int64_t i = 0; i < count; ++i) {
            for (int64_t k = 0; k < K; ++k) {
              // Code k: bits k*bits .. k*bits + bits-1 of the row, least significant first.
              int code = 0;
              for (int64_t bit = 0; bit < bits; ++bit) {
                const int64_t at = k * bits + bit;
                code |= ((t.packed[picks[i] * row_bytes + at / 8] >> (at % 8)) & 1) << bit;
              }
              const float want = scale_values[picks[i] * groups + k / group_size] *
                                 static_cast<float>(level_of(bits, grid, code));
              if (!same_bits(out.as<float>()[i * K + k], want)) {
                std::printf("FAIL %s row %" PRId64 " k=%" PRId64 "\n", g_running, picks[i], k);
                ++failures;
                break;
              }
            }
          }
        }
      }
    }
   }
  }
  std::printf("gather_rows %" PRId64 " failures\n", failures);
  return failures;
}

// half_to_float against the compiler's own conversion (NaNs: both NaN).
int64_t check_half_to_float() {
  int64_t failures = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    _Float16 x;
    std::memcpy(&x, &bits, sizeof x);
    const float want = static_cast<float>(x), got = cim::half_to_float(bits);
    if (!(std::isnan(want) ? std::isnan(got) : same_bits(want, got))) {
      if (failures++ < 5) std::printf("FAIL half_to_float(0x%04x) = %.9g, expected %.9g\n", h, double(got), double(want));
    }
  }
  std::printf("half_to_float %" PRId64 " failures\n", failures);
  return failures;
}

// The tuner times NTA variants last in a round (tune/tuner.cpp) by their flag: it must
// match what the name says, in every table.
int64_t check_nta_flags(const std::vector<const cim::KernelTable*>& tables) {
  int64_t failures = 0;
  for (const cim::KernelTable* t : tables) {
    for (int v = 0; v < t->variant_count; ++v) {
      const cim::KernelVariant& k = t->variants[v];
      if (k.nta != (std::strstr(k.name, "-nta") != nullptr)) {
        std::printf("FAIL %s %s: nta flag %d does not match its name\n", t->name, k.name, int(k.nta));
        ++failures;
      }
    }
  }
  return failures;
}

int main() {
  // Name the case when a guard page stops a kernel (this replaces ASan's handler too).
  struct sigaction on_fault = {};
  on_fault.sa_handler = report_fault;
  sigaction(SIGSEGV, &on_fault, nullptr);
  sigaction(SIGBUS, &on_fault, nullptr);

  std::vector<const cim::KernelTable*> tables;
  const char* available = nullptr;
  cim::select_kernels("portable", &available);
  std::printf("this CPU runs: %s\n", available);
  for (const char* name : {"avx2", "avx2_vnni", "avx512", "avx512_vnni"}) {
    if (const cim::KernelTable* t = cim::select_kernels(name, nullptr)) tables.push_back(t);
  }
  if (cim::select_kernels("no_such_isa", nullptr) != nullptr) {
    std::printf("FAIL select_kernels accepted an unknown name\n");
    return 1;
  }

  std::mt19937_64 rng(20240611);
  Tally accuracy[2];
  std::vector<Tally> tallies(tables.size() * 2);
  for (const Shape& s : shapes()) {
    Problem p(s, rng);
    for (int mi = 0; mi < 2; ++mi) {
      const Mode& mode = kModes[mi];
      Output oracle(s);
      std::snprintf(g_running, sizeof g_running, "portable %s %s", mode.name, describe(s).c_str());
      run(cim::portable_kernels().variants[0], mode, p, 0, s.M, oracle.data(), 0, p.weights().tiles);
      ++accuracy[mi].cases;
      if (!check_accuracy(mode, p, oracle, accuracy[mi])) ++accuracy[mi].failures;
      for (size_t t = 0; t < tables.size(); ++t) {
        Tally& tally = tallies[2 * t + mi];
        if (s.bits != 4) {  // other widths: the table's kernels per width, one strip and (int8 mode) two at once
          for (const cim::KernelVariant* set : {tables[t]->widths, tables[t]->widths_x2}) {
            if (set != tables[t]->widths && set[s.bits].matmul[mi] == tables[t]->widths[s.bits].matmul[mi]) continue;
            ++tally.cases;
            if (!check_variant(*tables[t], set[s.bits], mode, p, oracle, rng, set != tables[t]->widths)) {
              ++tally.failures;
            }
          }
          continue;
        }
        for (int v = 0; v < tables[t]->variant_count; ++v) {
          ++tally.cases;
          const bool decode_only = v != tables[t]->defaults[mode.int8 ? cim::kInt8 : cim::kFp32];
          if (!check_variant(*tables[t], tables[t]->variants[v], mode, p, oracle, rng, decode_only)) ++tally.failures;
        }
      }
    }
  }
  int64_t failures =
      accuracy[0].failures + accuracy[1].failures + check_gather(rng) + check_half_to_float() + check_nta_flags(tables);
  for (int mi = 0; mi < 2; ++mi) {
    std::printf("portable    %s %5" PRId64 " shapes, %" PRId64 " failed, worst error / bound = %.4f\n",
                kModes[mi].name, accuracy[mi].cases, accuracy[mi].failures, accuracy[mi].worst_ratio);
  }
  for (size_t t = 0; t < tallies.size(); ++t) {
    std::printf("%-11s %s %" PRId64 " kernel x shape cases (all widths and scale dtypes), %" PRId64
                " not bit-identical to portable\n",
                tables[t / 2]->name, kModes[t % 2].name, tallies[t].cases, tallies[t].failures);
    failures += tallies[t].failures;
  }
  std::printf(failures == 0 ? "PASS\n" : "FAIL\n");
  return failures == 0 ? 0 : 1;
}
