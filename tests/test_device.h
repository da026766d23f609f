// The device tests put their tensors on: FUSEBOX_TEST_DEVICE=cuda (or cuda:N) runs the tests that
// honour it (plugin tests through plugin_test_support.h, step-mode tests through tiny_lm.h) on a
// GPU; unset or "cpu" keeps them on the CPU.
#pragma once

#include <ATen/ATen.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace fusebox::testing {

inline at::Device test_device() {
  static const at::Device device = [] {
    const char* env = std::getenv("FUSEBOX_TEST_DEVICE");
    const at::Device d(env && *env ? std::string(env) : std::string("cpu"));
    if (d.is_cuda() && !at::hasCUDA())
      throw std::runtime_error("FUSEBOX_TEST_DEVICE=" + std::string(env) +
                               " but this LibTorch has no CUDA or no GPU is visible");
    return d;
  }();
  return device;
}

}  // namespace fusebox::testing
