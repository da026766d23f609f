// The real trainer program: exit codes and one-line errors on stderr.
#include <gtest/gtest.h>
#include <sched.h>
#include <torch/cuda.h>

#include <filesystem>
#include <string>

#include "../openblas_probe.h"
#include "trainer_test_util.h"

namespace fusebox::trainer {
namespace {

using testing::count_lines;
using testing::run_program;
using testing::TempDir;

TEST(TrainerBinary, ErrorsAreOneLineWithNonZeroExit) {
  TempDir dir;
  auto r = run_program("--optimizer sgd --max-train-steps=0", dir.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "trainer: error: --max-train-steps: must be at least 1, got 0\n");
  r = run_program("--optimzer sgd", dir.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err,
            "trainer: error: unknown option '--optimzer' (did you mean '--optimizer'?); see "
            "trainer --help\n");
  const std::string cfg = dir.write("bad.toml", "optimizer = \"sgd\"\n\nmodel_widht = 3\n");
  r = run_program("--config " + cfg, dir.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "trainer: error: " + cfg +
                       ":3:15: unknown key 'model_widht' (did you mean 'model_width'?)\n");
  r = run_program(std::string("--plugin-dir ") + FUSEBOX_TEST_PLUGIN_DIR +
                      " --optimizer-plugin tp_no_step_param.so --fused-backward-pass",
                  dir.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(count_lines(r.err), 1);
  EXPECT_NE(r.err.find("tp_no_step_param.so does not support --fused-backward-pass"),
            std::string::npos);
}

// Without a GPU (or with a CPU-only LibTorch) --device cuda is refused before anything is made.
TEST(TrainerBinary, DeviceCudaWithoutAGpuIsOneLineAndWritesNothing) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is visible: --device cuda trains";
  TempDir dir;
  auto r = run_program(
      "--optimizer sgd --device cuda --max-train-steps 1 --output-dir " + dir.file("run"),
      dir.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err,
            "trainer: error: --device cuda: this LibTorch has no CUDA support or no GPU is "
            "visible (nvidia-smi lists the GPUs); train with --device cpu\n");
  EXPECT_FALSE(std::filesystem::exists(dir.file("run")));
}

TEST(TrainerBinary, TrainsAndPrintsPlainLinesWhenNotATerminal) {
  TempDir dir;
  auto r = run_program(
      std::string("--plugin-dir ") + FUSEBOX_PLUGIN_DIR +
          " --optimizer sgd --model-width 8 --max-train-steps 4 --log-every 2 --threads 1"
          " --output-dir " +
          dir.file("out"),
      dir.str());
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("step 2/4  loss "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('\r'), std::string::npos);
  EXPECT_TRUE(std::filesystem::exists(dir.file("out/metrics.jsonl")));
  EXPECT_EQ(run_program("--version", dir.str()).code, 0);
}

using fusebox::testing::openblas_loaded;

TEST(TrainerBinary, SetsAndReportsBothThreadPools) {
  TempDir dir;
  const std::string base = std::string("--plugin-dir ") + FUSEBOX_PLUGIN_DIR +
                           " --optimizer sgd --model-width 8 --max-train-steps 1 --threads 1";
  auto r = run_program(base + " --blas-threads 2", dir.str());
  ASSERT_EQ(r.code, 0) << r.err;
  if (openblas_loaded())
    EXPECT_NE(r.out.find("threads: 1 intra-op, 2 OpenBLAS"), std::string::npos) << r.out;
  else
    EXPECT_NE(r.out.find("threads: 1 intra-op"), std::string::npos) << r.out;
  r = run_program(base + " --blas-threads -1", dir.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "trainer: error: --blas-threads: must be at least 0, got -1\n");
}

// Without --threads/--blas-threads both pools take the cores this process may use: a process
// pinned to one core (taskset, a cpuset) runs one thread in each, not one per core of the machine.
TEST(TrainerBinary, ThreadPoolsDefaultToTheCoresThisProcessMayUse) {
  if (std::system("command -v taskset >/dev/null") != 0) GTEST_SKIP() << "no taskset";
  TempDir dir;
  cpu_set_t mine;
  ASSERT_EQ(::sched_getaffinity(0, sizeof mine, &mine), 0);
  int first = 0;
  while (!CPU_ISSET(first, &mine)) ++first;
  const std::string cmd = "timeout -k 5 600 taskset -c " + std::to_string(first) + " " +
                          std::string(FUSEBOX_BIN_DIR) + "/trainer --plugin-dir " +
                          FUSEBOX_PLUGIN_DIR +
                          " --optimizer sgd --model-width 8 --max-train-steps 1 --output-dir '' >" +
                          dir.file("stdout.txt") + " 2>" + dir.file("stderr.txt");
  const int status = std::system(cmd.c_str());
  const std::string out = testing::read_text(dir.file("stdout.txt"));
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << testing::read_text(dir.file("stderr.txt"));
  EXPECT_NE(out.find(openblas_loaded() ? "threads: 1 intra-op, 1 OpenBLAS" : "threads: 1 intra-op"),
            std::string::npos)
      << out;
}

// The config file shown in docs/trainer.md is valid as written.
TEST(TrainerBinary, TheDocumentedConfigExampleIsValid) {
  TempDir dir;
  const std::string doc = testing::read_text(testing::repo_root() + "/docs/trainer.md");
  const std::string start = "```toml\n# run.toml\n";
  const size_t begin = doc.find(start);
  ASSERT_NE(begin, std::string::npos) << "the example is gone from docs/trainer.md";
  const size_t end = doc.find("```", begin + start.size());
  ASSERT_NE(end, std::string::npos);
  const std::string cfg =
      dir.write("run.toml", doc.substr(begin + 8, end - begin - 8));  // after "```toml\n"
  auto r = run_program("--config " + cfg + " --print-config", dir.str());
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("relative_step = false"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace fusebox::trainer
