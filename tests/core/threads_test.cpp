// set_compute_threads: LibTorch's intra-op pool and OpenBLAS's pool, each to its own size.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>
#include <thread>

#include "../openblas_probe.h"
#include "fusebox/core/host_resources.h"
#include "fusebox/core/threads.h"
#include "fusebox/error.h"

namespace {

// Restores the thread counts and the environment after each test.
class ComputeThreadsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("OPENBLAS_NUM_THREADS");
    before_ = fusebox::set_compute_threads(at::get_num_threads());
  }
  void TearDown() override {
    unsetenv("OPENBLAS_NUM_THREADS");
    fusebox::set_compute_threads(before_.intra_op, before_.blas);
  }
  fusebox::ComputeThreads before_;
};

using fusebox::testing::openblas_loaded;

TEST_F(ComputeThreadsTest, SetsIntraOpThreads) {
  for (int n : {2, 1}) {
    EXPECT_EQ(fusebox::set_compute_threads(n).intra_op, n);
    EXPECT_EQ(at::get_num_threads(), n);
  }
}

TEST_F(ComputeThreadsTest, SetsOpenBlasThreadsApartFromIntraOp) {
  if (!openblas_loaded()) GTEST_SKIP() << "this LibTorch does not use OpenBLAS";
  fusebox::ComputeThreads t = fusebox::set_compute_threads(1, 2);
  EXPECT_EQ(t.intra_op, 1);
  EXPECT_EQ(t.blas, 2);
  t = fusebox::set_compute_threads(2, 1);
  EXPECT_EQ(t.intra_op, 2);
  EXPECT_EQ(t.blas, 1);
  // 0 leaves the BLAS as it is.
  t = fusebox::set_compute_threads(1, 0);
  EXPECT_EQ(t.blas, 1);
  EXPECT_FALSE(t.blas_from_env);
}

TEST_F(ComputeThreadsTest, ExplicitEnvironmentWinsForBlas) {
  const int blas_before = fusebox::set_compute_threads(1, 1).blas;
  setenv("OPENBLAS_NUM_THREADS", "1", 1);
  const fusebox::ComputeThreads t = fusebox::set_compute_threads(2, 2);
  EXPECT_TRUE(t.blas_from_env);
  EXPECT_EQ(t.intra_op, 2);
  EXPECT_EQ(t.blas, blas_before);  // untouched
}

TEST_F(ComputeThreadsTest, RejectsBadCounts) {
  EXPECT_THROW(fusebox::set_compute_threads(0), fusebox::Error);
  EXPECT_THROW(fusebox::set_compute_threads(-3), fusebox::Error);
  EXPECT_THROW(fusebox::set_compute_threads(1, -1), fusebox::Error);
}

}  // namespace

// The cores this process may use (affinity mask and CPU quota: HostResources.*), at most the
// machine's.
TEST(ComputeThreads, AvailableCoresAreTheUsableCoresAndAtLeastOne) {
  EXPECT_GE(fusebox::available_cores(), 1);
  EXPECT_EQ(fusebox::available_cores(), fusebox::host::usable_cores());
  if (std::thread::hardware_concurrency() > 0) {
    EXPECT_LE(fusebox::available_cores(), static_cast<int>(std::thread::hardware_concurrency()));
  }
}
