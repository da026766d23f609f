// select_device / gpu_for_local_rank: each process of a data-parallel job trains on a GPU of its
// own, and a launch that would leave a rank without one is refused in one line.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "fusebox/core/device.h"
#include "fusebox/error.h"

namespace {

std::string error_of(int local_rank, int local_ranks, int gpus) {
  try {
    fusebox::gpu_for_local_rank(local_rank, local_ranks, gpus);
  } catch (const fusebox::Error& e) {
    return e.what();
  }
  return "";
}

TEST(Device, EachLocalRankGetsItsOwnGpu) {
  EXPECT_EQ(fusebox::gpu_for_local_rank(0, 1, 1), 0);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(fusebox::gpu_for_local_rank(r, 8, 8), r);
  // Fewer processes than GPUs: the first ones are used.
  EXPECT_EQ(fusebox::gpu_for_local_rank(1, 2, 4), 1);
}

TEST(Device, MoreRanksThanGpusIsOneLineSayingHowToLaunch) {
  const std::string e = error_of(2, 4, 2);
  ASSERT_FALSE(e.empty());
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  EXPECT_NE(e.find("--device cuda"), std::string::npos) << e;
  EXPECT_NE(e.find("local rank 2 of 4"), std::string::npos) << e;
  EXPECT_NE(e.find("2 visible"), std::string::npos) << e;
  EXPECT_NE(e.find("at most 2 processes per machine"), std::string::npos) << e;
  EXPECT_FALSE(error_of(-1, 1, 2).empty());
}

TEST(Device, NoGpuSaysToTrainOnTheCpu) {
  const std::string e = error_of(0, 1, 0);
  EXPECT_NE(e.find("no GPU is visible"), std::string::npos) << e;
  EXPECT_NE(e.find("--device cpu"), std::string::npos) << e;
}

TEST(Device, SelectsTheCpuOrTheLocalRanksGpu) {
  EXPECT_EQ(fusebox::select_device({"cpu", 3, 4}), c10::Device(c10::kCPU));
  EXPECT_THROW(fusebox::select_device({"tpu", 0, 1}), fusebox::Error);
  const int gpus = fusebox::visible_gpus();
  EXPECT_EQ(gpus > 0, at::hasCUDA());
  if (gpus == 0) {
    EXPECT_THROW(fusebox::select_device({"cuda", 0, 1}), fusebox::Error);
    return;
  }
  // The last GPU, so that "current device" cannot be right by default.
  const c10::Device d = fusebox::select_device({"cuda", gpus - 1, gpus});
  EXPECT_EQ(d, c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(gpus - 1)));
  EXPECT_EQ(at::empty({1}, at::kCUDA).device().index(), gpus - 1);
  fusebox::select_device({"cuda", 0, gpus});
  EXPECT_EQ(at::empty({1}, at::kCUDA).device().index(), 0);
  EXPECT_THROW(fusebox::select_device({"cuda", gpus, gpus + 1}), fusebox::Error);
}

}  // namespace
