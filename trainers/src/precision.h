// Mixed precision: an RAII scope that turns LibTorch's autocast on (LibTorch 1.13 has no guard).
#pragma once

#include <ATen/autocast_mode.h>

namespace fusebox::trainer {

/// Autocast to `dtype` on `device` for the guard's lifetime, restoring the previous state after;
/// does nothing when `enabled` is false. Nested guards behave like Python's torch.autocast.
class AutocastGuard {
 public:
  AutocastGuard(bool enabled, c10::DeviceType device, at::ScalarType dtype)
      : active_(enabled), cpu_(device == c10::kCPU) {
    if (!active_) return;
    if (cpu_) {
      prev_enabled_ = at::autocast::is_cpu_enabled();
      prev_dtype_ = at::autocast::get_autocast_cpu_dtype();
      at::autocast::set_cpu_enabled(true);
      at::autocast::set_autocast_cpu_dtype(dtype);
    } else {
      prev_enabled_ = at::autocast::is_enabled();
      prev_dtype_ = at::autocast::get_autocast_gpu_dtype();
      at::autocast::set_enabled(true);
      at::autocast::set_autocast_gpu_dtype(dtype);
    }
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!active_) return;
    // Leaving the outermost autocast scope frees the cached low-precision weight copies.
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    if (cpu_) {
      at::autocast::set_cpu_enabled(prev_enabled_);
      at::autocast::set_autocast_cpu_dtype(prev_dtype_);
    } else {
      at::autocast::set_enabled(prev_enabled_);
      at::autocast::set_autocast_gpu_dtype(prev_dtype_);
    }
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool active_, cpu_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kFloat;
};

}  // namespace fusebox::trainer
