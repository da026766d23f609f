// Helpers for fusebox's one-line messages.
#pragma once

#include <string>

namespace fusebox {

/// The first line of `text`: LibTorch's exception messages carry a stack trace after it, and
/// every fusebox error is one line.
inline std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

}  // namespace fusebox
