#include "mapped_file.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "fusebox/core/messages.h"
#include "fusebox/error.h"

namespace fusebox::detail {

namespace fs = std::filesystem;

void require_regular_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error(path.string() + does_not_exist(ec));
  if (!fs::is_regular_file(path, ec)) throw Error(path.string() + " is not a regular file");
}

std::shared_ptr<MappedFile> MappedFile::open(const fs::path& path, const std::string& where) {
  require_regular_file(path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot read " + where + ": " + std::strerror(errno));
  struct stat st {};
  const bool stated = ::fstat(fd, &st) == 0;
  const uint64_t total = stated ? static_cast<uint64_t>(st.st_size) : 0;
  void* base = stated && total > 0
                   ? ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0)
                   : nullptr;
  const int mapping_errno = errno;
  ::close(fd);
  if (!stated || base == MAP_FAILED)
    throw Error("cannot map " + where + " into memory: " + std::strerror(mapping_errno));
  return std::make_shared<MappedFile>(base, total);
}

MappedFile::~MappedFile() {
  if (size_ > 0) ::munmap(base_, size_);
}

at::Tensor widen_unsigned(const at::Tensor& carrier, at::ScalarType type) {
  return carrier.to(type).bitwise_and((int64_t{1} << (8 * carrier.element_size())) - 1);
}

bool valid_bools(const at::Tensor& t) {
  const auto* b = static_cast<const unsigned char*>(t.data_ptr());
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i)
    if (b[i] > 1) return false;
  return true;
}

}  // namespace fusebox::detail
