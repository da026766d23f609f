// The one place where LibTorch version differences live (1.13 on Debian; 2.x with CUDA).
//
// Checked against PyTorch 2.x sources: AccumulateGrad post hooks (Node::add_post_hook returning a
// uintptr_t key, del_post_hook(key)), FunctionPostHook::operator()(outputs, inputs) and
// impl::grad_accumulator are unchanged; 2.x only adds FunctionPostHook::compiled_args, used by
// compiled autograd alone. What changed is handled below: c10::Allocator (2.3: allocate() is no
// longer const and copy_data() is pure virtual) and the CUDA caching allocator's statistics (device
// argument int -> c10::DeviceIndex after 2.2; DeviceStats moved to c10::CachingDeviceAllocator in
// 2.6, still reachable through CUDACachingAllocator; its StatArray is a std::array indexed by
// StatType, AGGREGATE = 0, in every version).
//
// Gradient-ready hook: both 1.13 and 2.x run the post hooks of a leaf's AccumulateGrad node right
// after the gradient has been accumulated into param.grad(). (2.x also offers
// register_post_accumulate_grad_hook, but only through Python-specific hook types, so the
// AccumulateGrad post hook is the one mechanism that works in C++ on both.) The node is held
// weakly by the parameter: the hook object keeps it alive, or the hook would be lost.
#pragma once

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include <c10/core/Allocator.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>

#include "fusebox/error.h"

#if defined(FUSEBOX_WITH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

/// True when building against LibTorch major.minor or newer.
#define FUSEBOX_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||          \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

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

/// A c10::Allocator whose subclass implements allocate_bytes() once for every LibTorch version:
/// 1.13-2.2 declare `DataPtr allocate(size_t) const`; 2.3 made it non-const and added the pure
/// virtual copy_data() (memcpy for host memory).
class AllocatorBase : public c10::Allocator {
 public:
#if FUSEBOX_TORCH_AT_LEAST(2, 3)
  c10::DataPtr allocate(size_t nbytes) override { return allocate_bytes(nbytes); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#else
  c10::DataPtr allocate(size_t nbytes) const override { return allocate_bytes(nbytes); }
#endif

 protected:
  virtual c10::DataPtr allocate_bytes(size_t nbytes) const = 0;
};

#if defined(FUSEBOX_WITH_CUDA)
/// Runs `fn` on the current device's CUDA caching allocator only once that allocator is set up
/// (CUDA initialized, a device present): before that its statistics calls throw ("Invalid device
/// argument ... did you call init?"), e.g. in a CPU-only run of a CUDA build.
template <typename Fn>
inline void with_cuda_allocator(Fn&& fn) {
  if (c10::cuda::device_count() <= 0) return;
#if FUSEBOX_TORCH_AT_LEAST(2, 0)
  if (!c10::cuda::CUDACachingAllocator::get()->initialized()) return;
  fn(c10::cuda::current_device());
#else  // 1.13 has no initialized() query
  try {
    fn(c10::cuda::current_device());
  } catch (const c10::Error&) {
  }
#endif
}
#endif

/// Allocated/reserved bytes (current, peak) of the CUDA caching allocator on the current device
/// (zeros without CUDA or before CUDA is initialized).
struct CudaAllocatorStats {
  int64_t allocated = 0, peak_allocated = 0, reserved = 0, peak_reserved = 0;
};
inline CudaAllocatorStats cuda_allocator_stats() {
  CudaAllocatorStats out;
#if defined(FUSEBOX_WITH_CUDA)
  with_cuda_allocator([&out](c10::DeviceIndex device) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
    constexpr size_t kAll = 0;  // StatType::AGGREGATE (its namespace differs between versions)
    out.allocated = stats.allocated_bytes[kAll].current;
    out.peak_allocated = stats.allocated_bytes[kAll].peak;
    out.reserved = stats.reserved_bytes[kAll].current;
    out.peak_reserved = stats.reserved_bytes[kAll].peak;
  });
#endif
  return out;
}

/// Starts a new peak window of the CUDA caching allocator on the current device (no-op without
/// CUDA): the peaks cuda_allocator_stats() reports next are those since this call.
inline void reset_cuda_peak() {
#if defined(FUSEBOX_WITH_CUDA)
  with_cuda_allocator(
      [](c10::DeviceIndex device) { c10::cuda::CUDACachingAllocator::resetPeakStats(device); });
#endif
}

/// Autocast state per device type: 2.4 replaced the CPU/GPU-specific calls with ones taking the
/// device type (the old ones are deprecated there).
inline bool autocast_enabled(c10::DeviceType d) {
#if FUSEBOX_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(d);
#else
  return d == c10::kCPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}
inline void set_autocast_enabled(c10::DeviceType d, bool on) {
#if FUSEBOX_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(d, on);
#else
  d == c10::kCPU ? at::autocast::set_cpu_enabled(on) : at::autocast::set_enabled(on);
#endif
}
inline at::ScalarType autocast_dtype(c10::DeviceType d) {
#if FUSEBOX_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(d);
#else
  return d == c10::kCPU ? at::autocast::get_autocast_cpu_dtype()
                        : at::autocast::get_autocast_gpu_dtype();
#endif
}
inline void set_autocast_dtype(c10::DeviceType d, at::ScalarType t) {
#if FUSEBOX_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(d, t);
#else
  d == c10::kCPU ? at::autocast::set_autocast_cpu_dtype(t)
                 : at::autocast::set_autocast_gpu_dtype(t);
#endif
}

namespace detail {
template <class StoreOptions>
auto use_classic_tcp_store(StoreOptions& o, int) -> decltype(o.useLibUV = false, true) {
  o.useLibUV = false;
  return true;
}
template <class StoreOptions>
bool use_classic_tcp_store(StoreOptions&, long) {
  return false;
}
}  // namespace detail

/// Switches c10d's TCPStore to its classic backend where the options have a libuv switch (2.2+,
/// on by default from 2.4) and returns true; returns false where there is no switch. LibTorch
/// builds without libuv (Debian's among them) refuse the default with "use_libuv was requested
/// but PyTorch was build without libuv support".
template <class StoreOptions>
bool use_classic_tcp_store(StoreOptions& o) {
  return detail::use_classic_tcp_store(o, 0);
}

}  // namespace fusebox::compat
