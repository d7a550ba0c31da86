// How long a handoff to a spinning second thread takes after the caller was busy for a while
// (docs/real-llm.md, "What the genai loop adds at 2 threads"): the caller busy-waits P us,
// then bumps a counter that the other thread answers. The other thread spins with PAUSE
// (as ORT's pool does; under a hypervisor a PAUSE loop can cause pause-loop exits and a
// descheduled vCPU) or, with argument 1, without. Medians of 300 handoffs per P.
//
//   g++ -O2 -pthread ops/cpp/tools/handoff_bench.cpp -o handoff_bench && ./handoff_bench [0|1]
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

std::atomic<long> request{0}, answer{0};
std::atomic<bool> done{false};

double micros_since(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }

void answer_loop(bool pause) {
  long seen = 0;
  while (!done.load(std::memory_order_relaxed)) {
    const long r = request.load(std::memory_order_acquire);
    if (r != seen) {
      seen = r;
      answer.store(r, std::memory_order_release);
    } else if (pause) {
      _mm_pause();
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool pause = argc < 2 || std::atoi(argv[1]) == 0;
  std::thread other(answer_loop, pause);
  for (int busy_us : {0, 20, 50, 200, 1000, 5000}) {
    std::vector<double> took;
    for (int i = 0; i < 300; ++i) {
      const auto t0 = Clock::now();
      while (micros_since(t0) < busy_us) {
      }
      const auto t1 = Clock::now();
      const long r = request.fetch_add(1) + 1;
      while (answer.load(std::memory_order_acquire) != r) {
      }
      took.push_back(micros_since(t1));
    }
    std::sort(took.begin(), took.end());
    std::printf("%s, caller busy %5d us: handoff median %.2f us, 90th percentile %.2f, max %.1f\n",
                pause ? "PAUSE spin" : "plain spin", busy_us, took[150], took[270], took.back());
  }
  done = true;
  other.join();
  return 0;
}
