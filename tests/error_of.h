// What a call's fusebox::Error says, for the tests that check an error's words.
#pragma once

#include <functional>
#include <string>

#include "fusebox/error.h"

namespace fusebox::testing {

/// The message of the fusebox::Error that `f` throws, or "(no error)" when it throws none (so that
/// a check for a part of the message fails and shows why).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace fusebox::testing
