// The one place where LibTorch version differences live (1.13 on Debian; 2.x with CUDA).
//
// Gradient-ready hook: both 1.13 and 2.x run the post hooks of a leaf's AccumulateGrad node right
// after the gradient has been accumulated into param.grad(). (2.x also offers
// register_post_accumulate_grad_hook, but only through Python-specific hook types, so the
// AccumulateGrad post hook is the one mechanism that works in C++ on both.) The node is held
// weakly by the parameter: the hook object keeps it alive, or the hook would be lost.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include <functional>
#include <memory>
#include <utility>

#include "fusebox/error.h"

#if defined(FUSEBOX_WITH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace fusebox::compat {

/// Calls `fn` each time `param`'s gradient has been accumulated; unregisters on destruction.
class GradReadyHook {
 public:
  GradReadyHook(const at::Tensor& param, std::function<void()> fn) {
    if (!param.requires_grad() || !param.is_leaf())
      throw Error("fused stepping needs leaf parameters with requires_grad");
    node_ = torch::autograd::impl::grad_accumulator(param);
    if (!node_) throw Error("no gradient accumulator for a parameter");
    key_ = node_->add_post_hook(std::make_unique<PostHook>(std::move(fn)));
  }
  ~GradReadyHook() { node_->del_post_hook(key_); }
  GradReadyHook(const GradReadyHook&) = delete;
  GradReadyHook& operator=(const GradReadyHook&) = delete;

 private:
  struct PostHook : torch::autograd::FunctionPostHook {
    explicit PostHook(std::function<void()> f) : fn(std::move(f)) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      fn();
      return outputs;
    }
    std::function<void()> fn;
  };
  std::shared_ptr<torch::autograd::Node> node_;
  uintptr_t key_ = 0;
};

/// Allocated/reserved bytes (current, peak) of the CUDA caching allocator on the current device.
struct CudaAllocatorStats {
  int64_t allocated = 0, peak_allocated = 0, reserved = 0, peak_reserved = 0;
};
inline CudaAllocatorStats cuda_allocator_stats() {
  CudaAllocatorStats out;
#if defined(FUSEBOX_WITH_CUDA)
  if (c10::cuda::device_count() > 0) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
    constexpr size_t kAll = 0;  // StatType::AGGREGATE
    out.allocated = stats.allocated_bytes[kAll].current;
    out.peak_allocated = stats.allocated_bytes[kAll].peak;
    out.reserved = stats.reserved_bytes[kAll].current;
    out.peak_reserved = stats.reserved_bytes[kAll].peak;
  }
#endif
  return out;
}

}  // namespace fusebox::compat
