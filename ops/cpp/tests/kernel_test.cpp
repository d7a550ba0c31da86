// Kernel test: every kernel table this CPU runs, over many shapes, against a float64
// reference and the portable oracle.
//
// Every buffer a kernel touches ends against a PROT_NONE page: A's last row ends at K,
// the last weight row at its last packed byte, scales and bias at their last entry and
// Y's last row at N. A SIMD read of A past K, of codes past the row or a write past Y
// faults instead of passing. (For codes this is stricter than PackedWeights promises:
// rows are padded to 64 bytes, but these kernels never need the padding.) The only
// exception: shapes with a_pad, added to start A off a 64-byte line, leave a few floats
// between A and its guard page.
//
// Checked per table and shape:
//   accuracy     |y - exact| <= (K + 2) 2^-24 sum_k |a_k w_k| (+ the bias rounding)
//   oracle       |y - y_portable| within the sum of both bounds
//   split        the same bits whatever ranges [n_begin, n_end) the N rows come in
//   batch        the same bits for row m of A alone (M = 1) as within the batch
//   bounds       Y entries between N and ldy are left untouched
//
// Usage: kernel_test        (exit status 0 when every check passes)
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
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

struct Shape {
  int64_t M, N, K, group_size;
  int64_t lda, ldy;
  bool bias;
  bool wide_range;  // activations spread over many binades, to stress the bound
  // Floats between A's last row and its guard page (0: none), to start A off a 64-byte
  // line when K is a multiple of 16.
  int64_t a_pad = 0;
};

std::string describe(const Shape& s) {
  char buf[192];
  std::snprintf(buf, sizeof buf, "M=%" PRId64 " N=%" PRId64 " K=%" PRId64 " group=%" PRId64 " lda=%" PRId64
                " ldy=%" PRId64 " bias=%d wide=%d a_pad=%" PRId64,
                s.M, s.N, s.K, s.group_size, s.lda, s.ldy, int(s.bias), int(s.wide_range), s.a_pad);
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
        bias_(s.bias ? static_cast<size_t>(s.N) : 0),
        a_(static_cast<size_t>((s.M - 1) * s.lda + s.K)) {
    std::uniform_int_distribution<int> code(0, 15);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::uniform_int_distribution<int> binade(-20, 20);
    for (auto& c : codes_) c = static_cast<uint8_t>(code(rng));
    for (size_t i = 0; i < scales_.size(); ++i) {
      scales_[i] = (i % 7 == 3) ? 0.0f : 0.01f + 0.5f * std::fabs(uniform(rng));
    }
    for (auto& b : bias_) b = 4.0f * uniform(rng);
    for (auto& a : a_) a = s.wide_range ? std::ldexp(uniform(rng), binade(rng)) : uniform(rng);

    // Attribute layout: element k of row n in byte k / 2, even k in the low nibble,
    // padding past K is code 8.
    std::vector<uint8_t> packed(static_cast<size_t>(s.N * k_padded_ / 2), 0);
    for (int64_t n = 0; n < s.N; ++n) {
      for (int64_t k = 0; k < k_padded_; ++k) {
        const uint8_t c = k < s.K ? codes_[n * s.K + k] : 8;
        packed[n * k_padded_ / 2 + k / 2] |= static_cast<uint8_t>(k % 2 == 0 ? c : c << 4);
      }
    }
    const std::string err = storage_.build(s.K, s.N, s.group_size, packed.data(), scales_.data(),
                                           s.bias ? bias_.data() : nullptr);
    if (!err.empty()) {
      std::fprintf(stderr, "repack failed for %s: %s\n", describe(s).c_str(), err.c_str());
      std::exit(2);
    }

    // Guarded copies. The last weight row ends at its last packed byte, so a kernel may
    // read K_padded / 2 bytes of a row and no more.
    const cim::PackedWeights& src = storage_.weights();
    const int64_t row_used = k_padded_ / 2;
    nibbles_ = std::make_unique<GuardedBuffer>(static_cast<size_t>((s.N - 1) * src.row_bytes + row_used));
    std::memcpy(nibbles_->as<uint8_t>(), src.nibbles, static_cast<size_t>((s.N - 1) * src.row_bytes + row_used));
    scales_g_ = std::make_unique<GuardedBuffer>(scales_.size() * sizeof(float));
    std::memcpy(scales_g_->as<float>(), scales_.data(), scales_.size() * sizeof(float));
    if (s.bias) {
      bias_g_ = std::make_unique<GuardedBuffer>(bias_.size() * sizeof(float));
      std::memcpy(bias_g_->as<float>(), bias_.data(), bias_.size() * sizeof(float));
    }
    a_g_ = std::make_unique<GuardedBuffer>((a_.size() + static_cast<size_t>(s.a_pad)) * sizeof(float));
    std::memcpy(a_g_->as<float>(), a_.data(), a_.size() * sizeof(float));

    w_ = src;
    w_.nibbles = nibbles_->as<uint8_t>();
    w_.scales = scales_g_->as<float>();
    w_.bias = s.bias ? bias_g_->as<float>() : nullptr;
  }

  const Shape& shape() const { return s_; }
  const cim::PackedWeights& weights() const { return w_; }
  const float* a() { return a_g_->as<float>(); }

  // Exact y[m, n] and the bound on its float32 error.
  void reference(int64_t m, int64_t n, double& exact, double& bound) const {
    double sum = 0.0, abs_sum = 0.0;
    for (int64_t k = 0; k < s_.K; ++k) {
      const double w = (int(codes_[n * s_.K + k]) - 8) * double(scales_[n * groups_ + k / s_.group_size]);
      const double t = double(a_[m * s_.lda + k]) * w;
      sum += t;
      abs_sum += std::fabs(t);
    }
    const double u = std::ldexp(1.0, -24);
    bound = double(s_.K + 2) * u * abs_sum;
    exact = sum;
    if (s_.bias) {
      exact += bias_[n];
      bound += u * (std::fabs(exact) + bound);
    }
  }

 private:
  Shape s_;
  int64_t groups_, k_padded_;
  std::vector<uint8_t> codes_;  // [N, K], 0..15
  std::vector<float> scales_;   // [N, groups]
  std::vector<float> bias_;     // [N] or empty
  std::vector<float> a_;        // [M, lda], only the first K of each row used
  cim::PackedStorage storage_;
  std::unique_ptr<GuardedBuffer> nibbles_, scales_g_, bias_g_, a_g_;
  cim::PackedWeights w_;
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

cim::MatMulArgs args_for(Problem& p, const float* a, int64_t M, float* y) {
  cim::MatMulArgs args;
  args.A = a;
  args.M = M;
  args.lda = p.shape().lda;
  args.Y = y;
  args.ldy = p.shape().ldy;
  args.W = &p.weights();
  return args;
}

// Runs every check of one table on one problem; returns false (after printing why) on
// the first failure.
bool check_table(const cim::KernelTable& table, Problem& p, Output& oracle, std::mt19937_64& rng, Tally& tally) {
  const Shape& s = p.shape();
  const std::string where = std::string(table.name) + " " + describe(s);
  std::snprintf(g_running, sizeof g_running, "%s", where.c_str());

  Output whole(s);
  table.matmul(args_for(p, p.a(), s.M, whole.data()), 0, s.N);
  for (int64_t m = 0; m < s.M; ++m) {
    for (int64_t n = 0; n < s.N; ++n) {
      double exact, bound;
      p.reference(m, n, exact, bound);
      const double err = std::fabs(double(whole.at(m, n)) - exact);
      if (!(err <= bound)) {
        std::printf("FAIL %s: y[%" PRId64 ",%" PRId64 "] = %.9g, exact %.9g, error %.3g > bound %.3g\n",
                    where.c_str(), m, n, double(whole.at(m, n)), exact, err, bound);
        return false;
      }
      if (bound > 0) tally.worst_ratio = std::fmax(tally.worst_ratio, err / bound);
      if (!(std::fabs(double(whole.at(m, n)) - double(oracle.at(m, n))) <= 2 * bound)) {
        std::printf("FAIL %s: y[%" PRId64 ",%" PRId64 "] = %.9g but portable gives %.9g (bound %.3g)\n",
                    where.c_str(), m, n, double(whole.at(m, n)), double(oracle.at(m, n)), bound);
        return false;
      }
    }
  }
  if (!whole.padding_untouched()) {
    std::printf("FAIL %s: wrote Y between N and ldy\n", where.c_str());
    return false;
  }

  // N in random ranges, as ORT's thread pool would hand them out.
  Output split(s);
  std::uniform_int_distribution<int64_t> step(1, 9);
  for (int64_t n0 = 0; n0 < s.N;) {
    const int64_t n1 = std::min(s.N, n0 + step(rng));
    table.matmul(args_for(p, p.a(), s.M, split.data()), n0, n1);
    n0 = n1;
  }
  // Each row of A alone.
  Output rows(s);
  for (int64_t m = 0; m < s.M; ++m) {
    table.matmul(args_for(p, p.a() + m * s.lda, 1, rows.data() + m * s.ldy), 0, s.N);
  }
  for (int64_t m = 0; m < s.M; ++m) {
    for (int64_t n = 0; n < s.N; ++n) {
      if (!same_bits(split.at(m, n), whole.at(m, n))) {
        std::printf("FAIL %s: y[%" PRId64 ",%" PRId64 "] depends on the N split: %.9g vs %.9g\n", where.c_str(), m,
                    n, double(split.at(m, n)), double(whole.at(m, n)));
        return false;
      }
      if (!same_bits(rows.at(m, n), whole.at(m, n))) {
        std::printf("FAIL %s: y[%" PRId64 ",%" PRId64 "] differs between M=%" PRId64 " and M=1: %.9g vs %.9g\n",
                    where.c_str(), m, n, s.M, double(whole.at(m, n)), double(rows.at(m, n)));
        return false;
      }
    }
  }
  return true;
}

std::vector<Shape> shapes() {
  const int64_t group_sizes[] = {16, 32, 64, 128, 256};
  // Around every unit and group boundary, plus a few long rows.
  const int64_t ks[] = {1,   2,   3,   5,   7,   8,   9,   15,  16,  17,  24,  31,   32,   33,   40,  47,
                        48,  49,  63,  64,  65,  96,  100, 127, 128, 129, 200, 255,  256,  257,  300, 383,
                        384, 385, 511, 512, 513, 640, 777, 1000, 1024, 1031, 2048, 4096, 4099};
  // (M, N) pairs covering every remainder of the register blocks (up to 4 x 4), more
  // than one block, and more than one 32-row panel; then for the dequantized-panel
  // prefill (M >= 6 for AVX2, >= 10 for AVX-512): tiles of 3 to 6 rows of A, more than
  // one 16-row panel and a partial one, and more than one m-block of 12 tiles (M > 72).
  const int64_t mn[][2] = {{1, 1}, {1, 4},  {1, 7},   {1, 18},  {2, 3},  {3, 2},  {4, 4},
                           {5, 9}, {7, 5},  {9, 17},  {13, 6},  {6, 37}, {8, 20}, {10, 3},
                           {12, 35}, {31, 16}, {83, 19}};
  std::vector<Shape> out;
  int64_t i = 0;
  for (int64_t g : group_sizes) {
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
  return out;
}

}  // namespace

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
  for (const char* name : {"portable", "avx2", "avx512"}) {
    if (const cim::KernelTable* t = cim::select_kernels(name, nullptr)) tables.push_back(t);
  }
  if (cim::select_kernels("no_such_isa", nullptr) != nullptr) {
    std::printf("FAIL select_kernels accepted an unknown name\n");
    return 1;
  }

  std::mt19937_64 rng(20240611);
  std::vector<Tally> tallies(tables.size());
  for (const Shape& s : shapes()) {
    Problem p(s, rng);
    Output oracle(s);
    cim::portable_kernels().matmul(args_for(p, p.a(), s.M, oracle.data()), 0, s.N);
    for (size_t t = 0; t < tables.size(); ++t) {
      ++tallies[t].cases;
      if (!check_table(*tables[t], p, oracle, rng, tallies[t])) ++tallies[t].failures;
    }
  }
  int64_t failures = 0;
  for (size_t t = 0; t < tables.size(); ++t) {
    std::printf("%-9s %5" PRId64 " shapes, %" PRId64 " failed, worst error / bound = %.4f\n", tables[t]->name,
                tallies[t].cases, tallies[t].failures, tallies[t].worst_ratio);
    failures += tallies[t].failures;
  }
  std::printf(failures == 0 ? "PASS\n" : "FAIL\n");
  return failures == 0 ? 0 : 1;
}
