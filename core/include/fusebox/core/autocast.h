// Mixed precision: an RAII scope that turns LibTorch's autocast on (LibTorch has no C++ guard).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>

namespace fusebox {

/// Autocast to `dtype` on `device` for the guard's lifetime, restoring the previous state after;
/// does nothing when `enabled` is false. Nested guards behave like Python's torch.autocast.
class AutocastGuard {
 public:
  AutocastGuard(bool enabled, c10::DeviceType device, at::ScalarType dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool active_;
  c10::DeviceType device_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kFloat;
};

/// Switches autocast off on `device` for the guard's lifetime, restoring the previous state after
/// (Python's torch.autocast(enabled=False)): for an op that must run in the dtype its inputs have.
class AutocastOffGuard {
 public:
  explicit AutocastOffGuard(c10::DeviceType device);
  ~AutocastOffGuard();
  AutocastOffGuard(const AutocastOffGuard&) = delete;
  AutocastOffGuard& operator=(const AutocastOffGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
};

/// The dtype autocast casts to on `device` now, or nullopt when autocast is off there.
std::optional<at::ScalarType> active_autocast_dtype(c10::DeviceType device);

}  // namespace fusebox
