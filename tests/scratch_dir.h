// A fresh folder under the system's temp folder, removed with everything in it when the test ends,
// so that the suite leaves nothing behind in /tmp, whichever way a test finishes. And the bytes of
// a file, for tests that compare or alter what was written.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <system_error>

namespace fusebox::testing {

class ScratchDir {
 public:
  /// `label` shows in the folder's name; the process id and a random number make it unique, so
  /// that runs of the suite side by side never share one.
  explicit ScratchDir(const std::string& label) {
    path_ = std::filesystem::temp_directory_path() /
            ("fusebox-" + label + "-" + std::to_string(::getpid()) + "-" +
             std::to_string(std::random_device{}()));
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    // A test may have taken write permission away from a folder inside (to make a write fail);
    // give it back first, or a non-root user could not remove what is below it.
    std::error_code ec;
    for (auto it = std::filesystem::recursive_directory_iterator(path_, ec);
         !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec))
      if (it->is_directory(ec) && !it->is_symlink(ec))
        std::filesystem::permissions(it->path(), std::filesystem::perms::owner_all,
                                     std::filesystem::perm_options::add, ec);
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }
  /// The path of `name` inside the folder.
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

/// The bytes of the file at `path` ("" when it cannot be read).
inline std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace fusebox::testing
