// fusebox SDK: the one exception type of fusebox.
#pragma once

#include <stdexcept>
#include <string>

// Symbols that must be unique across the host and every plugin (type info of SDK classes).
#define FUSEBOX_VISIBLE __attribute__((visibility("default")))

namespace fusebox {

/// Thrown for every user-facing failure; what() is one line naming the thing and the fix.
class FUSEBOX_VISIBLE Error : public std::runtime_error {
 public:
  /// Builds an error from a complete one-line message.
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace fusebox
