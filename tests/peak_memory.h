// The growth of the process's peak resident memory while something runs, from /proc/self/status:
// for tests that show an operation holds no copy of a large file (a copy raises the peak by its
// size). And whether a file is mapped, for tests that show tensors view a file.
#pragma once

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <string>

namespace fusebox::testing {

/// A field of /proc/self/status in KiB ("VmRSS": resident now, "VmHWM": the peak), -1 if absent.
inline long long status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  return -1;
}

/// Runs `f` and returns how many KiB the peak resident memory grew by meanwhile; nothing where
/// that cannot be measured (the tests then check nothing of it): under AddressSanitizer (shadow
/// memory and a quarantine of freed blocks make the resident size no measure of the code), or where
/// /proc/self/clear_refs, which starts a new peak, cannot be written. `f` runs either way.
inline std::optional<long long> peak_growth_kib(const std::function<void()>& f) {
  bool measures = true;
#if defined(__SANITIZE_ADDRESS__)
  measures = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  measures = false;
#endif
#endif
  measures = measures && static_cast<bool>(std::ofstream("/proc/self/clear_refs") << "5");
  const long long before = status_kib("VmRSS");
  f();
  if (!measures || before < 0) return std::nullopt;
  return status_kib("VmHWM") - before;
}

/// Whether the file at `path` is mapped into this process now (/proc/self/maps names it).
inline bool is_mapped(const std::filesystem::path& path) {
  std::ifstream maps("/proc/self/maps");
  const std::string all((std::istreambuf_iterator<char>(maps)), std::istreambuf_iterator<char>());
  return all.find(std::filesystem::canonical(path).string()) != std::string::npos;
}

}  // namespace fusebox::testing
