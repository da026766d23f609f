#include "fusebox/core/autocast.h"

#include "torch_compat.h"

namespace fusebox {

AutocastGuard::AutocastGuard(bool enabled, c10::DeviceType device, at::ScalarType dtype)
    : active_(enabled), device_(device) {
  if (!active_) return;
  prev_enabled_ = compat::autocast_enabled(device_);
  prev_dtype_ = compat::autocast_dtype(device_);
  compat::set_autocast_enabled(device_, true);
  compat::set_autocast_dtype(device_, dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  // Leaving the outermost autocast scope frees the cached low-precision weight copies.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_enabled(device_, prev_enabled_);
  compat::set_autocast_dtype(device_, prev_dtype_);
}

AutocastOffGuard::AutocastOffGuard(c10::DeviceType device)
    : device_(device), prev_enabled_(compat::autocast_enabled(device)) {
  compat::set_autocast_enabled(device_, false);
  at::autocast::increment_nesting();
}

AutocastOffGuard::~AutocastOffGuard() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_enabled(device_, prev_enabled_);
}

std::optional<at::ScalarType> active_autocast_dtype(c10::DeviceType device) {
  if (!compat::autocast_enabled(device)) return std::nullopt;
  return compat::autocast_dtype(device);
}

}  // namespace fusebox
