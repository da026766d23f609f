// Thousands of small steps keep flat memory: tensor memory per step is constant, and the process
// does not grow (no leak per step in the hooks, the optimizers or the metrics writer).
#include <gtest/gtest.h>

#include <fstream>

#include "trainer_test_util.h"

using namespace fusebox::trainer::testing;

namespace {

int64_t resident_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  return -1;
}

// The "peak_bytes" of every line of a metrics.jsonl file.
std::vector<int64_t> peaks(const std::string& jsonl) {
  std::vector<int64_t> out;
  std::ifstream in(jsonl);
  std::string line;
  while (std::getline(in, line)) {
    size_t p = line.find("\"peak_bytes\":");
    if (p != std::string::npos) out.push_back(std::stoll(line.substr(p + 13)));
  }
  return out;
}

}  // namespace

TEST(TrainerLongRun, ThousandsOfStepsKeepFlatMemory) {
  TempDir tmp;
  for (const std::string mode : {"--fused-backward-pass", "--fused-optimizer-groups=3", ""}) {
    SCOPED_TRACE(mode);
    auto args = [&](int steps) {
      std::vector<std::string> a{"--model",           "mlp",
                                 "--model-width",     "16",
                                 "--threads",         "1",
                                 "--optimizer",       "adamw",
                                 "--max-train-steps", std::to_string(steps),
                                 "--output-dir",      tmp.file("run"),
                                 "--log-every",       "100000"};
      if (!mode.empty()) a.push_back(mode);
      return a;
    };
    ASSERT_EQ(run_trainer(args(300)).code, 0);  // warm-up: allocator pools, plugin loading
    const int64_t before = resident_kib();
    auto r = run_trainer(args(3000));
    ASSERT_EQ(r.code, 0) << r.err;
    const int64_t after = resident_kib();
    EXPECT_LT(after - before, 8 * 1024) << "resident memory grew by " << (after - before) << " KiB";
    auto p = peaks(tmp.file("run") + "/metrics.jsonl");
    ASSERT_EQ(p.size(), 3000u);
    EXPECT_EQ(p[100], p.back());  // tensor memory per step is the same at step 100 and 3000
  }
}
