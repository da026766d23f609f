// Writing a file whole or not at all, streamed: the bytes go to a temporary file beside it, which
// is fsynced and renamed over it (write_file_atomically in fusebox/core/checkpoint.h is the same
// for bytes already in memory).
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>

namespace fusebox::detail {

/// Writes `path` atomically, its bytes written to the open temporary file (`fd`) by `write`, which
/// returns nullptr, or the call that failed ("write") with errno set. Throws Error naming the path
/// when a call fails; what `write` throws removes the temporary and passes on.
void write_file_atomically_with(const std::filesystem::path& path,
                                const std::function<const char*(int fd)>& write);

/// Writes the `n` bytes at `p` to `fd`. Returns nullptr, or "write" with errno set.
const char* write_all(int fd, const char* p, size_t n);

}  // namespace fusebox::detail
