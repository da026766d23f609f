// "Did you mean" suggestions for misspelt keys and options.
#pragma once

#include <string>
#include <vector>

namespace fusebox {

/// The candidate closest to `word` by edit distance, or "" when none is plausibly meant.
std::string nearest(const std::string& word, const std::vector<std::string>& candidates);

/// " (did you mean 'x'?)" or "" — ready to append to a message.
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace fusebox
