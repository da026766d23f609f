// Helpers for fusebox's one-line messages.
#pragma once

#include <string>
#include <system_error>

namespace fusebox {

/// The first line of `text`: LibTorch's exception messages carry a stack trace after it, and
/// every fusebox error is one line.
inline std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

/// `text` with its line breaks written as \n and \r: an error stays one line even when what it
/// names (a path, a value) holds a line break.
inline std::string one_line(const std::string& text) {
  std::string out;
  for (char ch : text) out += ch == '\n' ? "\\n" : ch == '\r' ? "\\r" : std::string(1, ch);
  return out;
}

/// " does not exist", or why a path that may exist cannot be reached (a symlink loop, a folder
/// on the way this user cannot search), from the error fs::exists(path, ec) left in `ec`.
inline std::string does_not_exist(const std::error_code& ec) {
  return ec ? " cannot be reached (" + ec.message() + ")" : " does not exist";
}

}  // namespace fusebox
