// Sizes the machine cannot hold, through the real trainer program: a built-in model whose
// parameters exceed the memory this process may use (the physical memory, or a cgroup limit) is
// refused before it is built (exit 2), and an allocation
// that fails during training is one line naming the step, the size and the options (exit 3);
// both at once, without filling the memory.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>

#include "fusebox/core/host_resources.h"
#include "model.h"
#include "trainer_test_util.h"

using namespace fusebox::trainer::testing;

namespace {

// What the trainer sizes against: the physical memory, or a lower cgroup limit on this process.
int64_t physical_memory() { return fusebox::host::usable_memory().bytes; }

// A cgroup of this test's own, below the one it runs in, for the memory controller (v1, or v2
// where the controller can be enabled below): made by root only, so the test skips elsewhere.
class MemoryCgroup {
 public:
  explicit MemoryCgroup(int64_t limit) {
    std::ifstream in("/proc/self/cgroup");
    std::string line, v1, v2;
    while (std::getline(in, line)) {
      const size_t a = line.find(':'), b = line.find(':', a + 1);
      const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
      if (line.compare(0, 2, "0:") == 0 && controllers.empty()) v2 = path;
      if (("," + controllers + ",").find(",memory,") != std::string::npos) v1 = path;
    }
    const std::string name = "/fusebox-test-" + std::to_string(::getpid());
    std::error_code ec;
    if (!v1.empty() && std::filesystem::exists("/sys/fs/cgroup/memory/memory.limit_in_bytes")) {
      dir_ = "/sys/fs/cgroup/memory" + (v1 == "/" ? "" : v1) + name;
      if (!std::filesystem::create_directory(dir_, ec) ||
          !write(dir_ + "/memory.limit_in_bytes", std::to_string(limit)))
        clear();
    } else if (!v2.empty()) {
      dir_ = "/sys/fs/cgroup" + (v2 == "/" ? "" : v2) + name;
      if (!std::filesystem::create_directory(dir_, ec) ||
          !write(dir_ + "/memory.max", std::to_string(limit)))
        clear();
    }
  }
  ~MemoryCgroup() { clear(); }
  bool made() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }
  // Runs the trainer inside this cgroup with `args`; its stderr is `err`, and `status` is
  // std::system's (killed or exited).
  struct Run {
    int status = 0;
    std::string err;
  };
  Run trainer(const std::string& args, const TempDir& tmp) const {
    const std::string cmd = "sh -c 'echo $$ > " + dir_ + "/cgroup.procs && exec timeout -k 5 600 " +
                            std::string(FUSEBOX_BIN_DIR) + "/trainer " + args + "' >" +
                            tmp.file("stdout.txt") + " 2>" + tmp.file("stderr.txt");
    Run r;
    r.status = std::system(cmd.c_str());
    r.err = read_text(tmp.file("stderr.txt"));
    return r;
  }

 private:
  static bool write(const std::string& file, const std::string& text) {
    std::ofstream out(file);
    out << text << std::flush;
    return static_cast<bool>(out);
  }
  void clear() {
    if (!dir_.empty()) ::rmdir(dir_.c_str());
    dir_.clear();
  }
  std::string dir_;
};

// The largest resident set of any child process that has ended so far, in KiB.
long children_max_rss_kib() {
  struct rusage u {};
  ::getrusage(RUSAGE_CHILDREN, &u);
  return u.ru_maxrss;
}

struct Timed {
  Result result;
  double seconds = 0;
};

// Runs the trainer with its address space limited to `limit_kib`: should the size check fail to
// refuse, the trainer's allocations fail at that limit instead of filling the machine's memory.
Timed run_limited(const std::string& args, const std::string& dir, int64_t limit_kib) {
  const std::string out = dir + "/stdout.txt", err = dir + "/stderr.txt";
  const std::string cmd = "ulimit -v " + std::to_string(limit_kib) + " && timeout -k 5 600 " +
                          std::string(FUSEBOX_BIN_DIR) + "/trainer " + args + " >" + out + " 2>" +
                          err;
  const auto start = std::chrono::steady_clock::now();
  const int status = std::system(cmd.c_str());
  Timed t;
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  t.result.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  t.result.out = read_text(out), t.result.err = read_text(err);
  return t;
}

// Well above what a small run of the trainer maps (LibTorch, thread stacks), well below any
// machine these tests run on.
constexpr int64_t kLimitKiB = 4 * 1024 * 1024;

}  // namespace

// The estimate that the check relies on is the number of parameters the models really have.
TEST(TrainerMemoryLimits, ParameterCountsFromTheOptionsMatchTheBuiltModels) {
  using fusebox::trainer::ModelOptions;
  std::vector<ModelOptions> cases;
  for (int64_t depth : {1, 3}) {
    ModelOptions o;
    o.kind = "mlp", o.width = 12, o.depth = depth;
    cases.push_back(o);
    o.kind = "transformer", o.heads = 2, o.seq_len = 7, o.vocab_size = 19;
    cases.push_back(o);
  }
  for (int64_t depth : {1, 2, 3, 4}) {  // channels stop doubling after level 2
    ModelOptions o;
    o.kind = "denoiser", o.width = 8, o.depth = depth, o.image_size = 8;
    cases.push_back(o);
  }
  for (const ModelOptions& o : cases) {
    SCOPED_TRACE(o.kind + " depth " + std::to_string(o.depth));
    auto model = fusebox::trainer::make_builtin_model(o);
    EXPECT_EQ(fusebox::trainer::builtin_parameter_count(o),
              static_cast<double>(fusebox::trainer::count_elements(model->parameters())));
  }
}

TEST(TrainerMemoryLimits, AModelLargerThanTheMachineIsRefusedBeforeItIsBuilt) {
  TempDir tmp;
  const int64_t memory = physical_memory();
  ASSERT_GT(memory, 0);
  // 1000 layers that together need twice the memory there is, each a small part of it: without
  // the check they would be built one by one until the memory runs out.
  const int64_t width =
      static_cast<int64_t>(std::ceil(std::sqrt(2.0 * static_cast<double>(memory) / 4 / 1000)));
  const std::string common =
      "--optimizer sgd --max-train-steps 1 --threads 1 --output-dir " + tmp.file("out") + " ";
  auto t =
      run_limited(common + "--model mlp --model-depth 1000 --model-width " + std::to_string(width),
                  tmp.str(), kLimitKiB);
  EXPECT_EQ(t.result.code, 2) << t.result.err;
  EXPECT_EQ(count_lines(t.result.err), 1) << t.result.err;
  EXPECT_EQ(t.result.err.rfind("trainer: error: cannot build the mlp model: its ", 0), 0u)
      << t.result.err;
  EXPECT_NE(t.result.err.find(" in float32, more than the "), std::string::npos) << t.result.err;
  EXPECT_NE(t.result.err.find(" of memory this machine has; lower --model-width or --model-depth"),
            std::string::npos)
      << t.result.err;
  EXPECT_LT(t.seconds, 60) << "the refusal should come at once";
  EXPECT_LT(children_max_rss_kib(), 2 * 1024 * 1024) << "nothing should have been built";
  EXPECT_FALSE(std::filesystem::exists(tmp.file("out")));

  // bf16 parameters are built in float32 first; a transformer's table grows with the vocabulary.
  t = run_limited(common + "--model transformer --model-width 64 --full-bf16 --vocab-size " +
                      std::to_string(memory / 64 / 4 * 2),
                  tmp.str(), kLimitKiB);
  EXPECT_EQ(t.result.code, 2) << t.result.err;
  EXPECT_NE(t.result.err.find(
                " as it is built in float32 (before its conversion to bf16), more than the "),
            std::string::npos)
      << t.result.err;
  EXPECT_NE(t.result.err.find("lower --model-width, --model-depth, --vocab-size or --seq-len"),
            std::string::npos)
      << t.result.err;

  // Each local rank of a data-parallel job builds its own copy: two that fit once but not twice.
  const int64_t layers = static_cast<int64_t>(0.75 * static_cast<double>(memory) / 4 /
                                              static_cast<double>(width * width + width));
  t = run_limited(common + "--model mlp --nproc-per-node 2 --model-width " + std::to_string(width) +
                      " --model-depth " + std::to_string(layers),
                  tmp.str(), kLimitKiB);
  EXPECT_EQ(t.result.code, 2) << t.result.err;
  EXPECT_NE(t.result.err.find(" in each of the 2 ranks on this machine ("), std::string::npos)
      << t.result.err;
  EXPECT_NE(t.result.err.find("lower --model-width, --model-depth or --nproc-per-node"),
            std::string::npos)
      << t.result.err;
  // A depth past the maximum is refused before anything else.
  t = run_limited(common + "--model-depth 100000000", tmp.str(), kLimitKiB);
  EXPECT_EQ(t.result.code, 2) << t.result.err;
  EXPECT_EQ(t.result.err, "trainer: error: --model-depth: must be at most 10000, got 100000000\n");
  EXPECT_LT(children_max_rss_kib(), 2 * 1024 * 1024);
}

// In a container or a batch job the cgroup's limit counts, not the machine's memory: a model that
// the machine could hold but the cgroup cannot is refused, not killed by the OOM killer.
TEST(TrainerMemoryLimits, AModelLargerThanTheCgroupLimitIsRefusedBeforeItIsBuilt) {
  constexpr int64_t kLimit = int64_t{1} << 30;
  if (fusebox::host::usable_memory().bytes < 4 * kLimit) GTEST_SKIP() << "a small machine";
  MemoryCgroup cgroup(kLimit);
  if (!cgroup.made()) GTEST_SKIP() << "cannot make a memory cgroup here (needs root)";
  TempDir tmp;
  // 1000 layers of 2 GiB in all: twice the limit, well below the machine.
  const auto [status, err] = cgroup.trainer(
      "--optimizer sgd --max-train-steps 1 --threads 1 --model mlp --model-depth 1000 "
      "--model-width 733 --output-dir " +
          tmp.file("out"),
      tmp);
  ASSERT_TRUE(WIFEXITED(status)) << "killed: " << err;
  EXPECT_EQ(WEXITSTATUS(status), 2) << err;
  EXPECT_EQ(count_lines(err), 1) << err;
  EXPECT_NE(err.find(" in float32, more than the 1.0 GiB of memory this process may use (the "
                     "cgroup limit in " +
                     cgroup.dir() + "/memory."),
            std::string::npos)
      << err;
  EXPECT_FALSE(std::filesystem::exists(tmp.file("out")));
}

// A model that fits but whose batch does not: each allocation alone passes the kernel's overcommit
// check, and together they would fill the cgroup until its out-of-memory killer ended the run
// without a word. The memory guard refuses the one that the cgroup's headroom cannot hold.
TEST(TrainerMemoryLimits, ABatchLargerThanTheCgroupLimitEndsWithAMessageNotAKill) {
  constexpr int64_t kLimit = int64_t{1} << 30;
  if (fusebox::host::usable_memory().bytes < 4 * kLimit) GTEST_SKIP() << "a small machine";
  MemoryCgroup cgroup(kLimit);
  if (!cgroup.made()) GTEST_SKIP() << "cannot make a memory cgroup here (needs root)";
  TempDir tmp;
  // 2^21 samples of 64 floats: 512 MiB for the inputs, as much for each layer's activations.
  const auto [status, err] = cgroup.trainer(
      "--optimizer sgd --max-train-steps 1 --threads 1 --model mlp --train-batch-size 2097152 "
      "--output-dir " +
          tmp.file("out"),
      tmp);
  ASSERT_TRUE(WIFEXITED(status)) << "killed: " << err;
  EXPECT_EQ(WEXITSTATUS(status), 3) << err;
  EXPECT_EQ(count_lines(err), 1) << err;
  EXPECT_EQ(err.rfind("trainer: error: training failed at step 1: out of memory: it tried to "
                      "allocate 512.0 MiB at once, but only ",
                      0),
            0u)
      << err;
  EXPECT_NE(err.find(" of memory is free and the run's tensors hold "), std::string::npos) << err;
  EXPECT_NE(err.find(" (--memory-guard); lower --train-batch-size"), std::string::npos) << err;
  EXPECT_FALSE(std::filesystem::exists(tmp.file("out/metrics.jsonl")));
}

// 10^12 samples of 64 floats are 232.8 TiB, more than any address space holds: the allocation is
// refused at once (by the memory guard, else by the kernel), without paging, and the message says
// what to lower.
TEST(TrainerMemoryLimits, RunningOutOfMemoryWhileTrainingIsOneLineNamingTheStep) {
  TempDir tmp;
  const std::string common = "--optimizer sgd --max-train-steps 2 --threads 1 --model-width 64 ";
  const auto start = std::chrono::steady_clock::now();
  auto r = run_program(common + "--train-batch-size 1000000000000 --output-dir " + tmp.file("out"),
                       tmp.str());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_EQ(r.err.rfind("trainer: error: training failed at step 1: out of memory: it tried to "
                        "allocate 232.8 TiB at once, but only ",
                        0),
            0u)
      << r.err;
  EXPECT_NE(r.err.find("; lower --train-batch-size (a higher --gradient-accumulation-steps keeps "
                       "the samples per step), --model-width or --model-depth, or use "
                       "--gradient-checkpointing\n"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("enforce fail"), std::string::npos) << r.err;
  EXPECT_LT(seconds, 60);
  EXPECT_LT(children_max_rss_kib(), 2 * 1024 * 1024) << "the batch was not allocated";
  EXPECT_FALSE(std::filesystem::exists(tmp.file("out/metrics.jsonl")));

  // The denoiser names its image size; the fused mode has no gradient accumulation to offer, and
  // a run that recomputes its blocks already does.
  r = run_program(
      "--optimizer sgd --max-train-steps 1 --threads 1 --model denoiser --model-width 8 "
      "--fused-backward-pass --gradient-checkpointing --train-batch-size 1000000000000 "
      "--output-dir ''",
      tmp.str());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("training failed at step 1: out of memory: it tried to allocate "),
            std::string::npos)
      << r.err;
  EXPECT_NE(
      r.err.find("; lower --train-batch-size, --image-size, --model-width or --model-depth\n"),
      std::string::npos)
      << r.err;
}
