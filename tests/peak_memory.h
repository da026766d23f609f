// The process's resident memory and its peak, from /proc/self/status: for tests that show an
// operation holds no copy of a large file (a copy raises the peak by its size).
#pragma once

#include <fstream>
#include <string>

namespace fusebox::testing {

/// A field of /proc/self/status in KiB ("VmRSS": resident now, "VmHWM": the peak), -1 if absent.
inline long long status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  return -1;
}

/// Starts a new peak (VmHWM = VmRSS); false where /proc/self/clear_refs cannot be written.
inline bool reset_peak_rss() {
  return static_cast<bool>(std::ofstream("/proc/self/clear_refs") << "5");
}

/// Under AddressSanitizer (shadow memory, a quarantine of freed blocks) the resident size measures
/// nothing about the code under test.
constexpr bool kResidentSizeMeasures =
#if defined(__SANITIZE_ADDRESS__)
    false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
    false;
#else
    true;
#endif
#else
    true;
#endif

}  // namespace fusebox::testing
