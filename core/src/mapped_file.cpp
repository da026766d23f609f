#include "mapped_file.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

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
  // In place on the new tensor: no second temporary of the widened size.
  return carrier.to(type).bitwise_and_((int64_t{1} << (8 * carrier.element_size())) - 1);
}

float float8_value(uint8_t bits, Float8 format) {
  const bool e4m3 = format == Float8::kE4M3;
  const int mantissa_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const int exponent = (bits & 0x7F) >> mantissa_bits, mantissa = bits & ((1 << mantissa_bits) - 1);
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  if (e4m3 && exponent == 15 && mantissa == 7) return std::numeric_limits<float>::quiet_NaN();
  if (!e4m3 && exponent == 31)
    return mantissa == 0 ? sign * std::numeric_limits<float>::infinity()
                         : std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0)
    return sign * std::ldexp(static_cast<float>(mantissa), 1 - bias - mantissa_bits);
  return sign * std::ldexp(static_cast<float>((1 << mantissa_bits) + mantissa),
                           exponent - bias - mantissa_bits);
}

at::Tensor widen_float8(const at::Tensor& bytes, Float8 format) {
  // bfloat16 is float32's top half: exact values need no rounding, only the top 16 bits.
  uint16_t table[256];
  for (int b = 0; b < 256; ++b) {
    const float v = float8_value(static_cast<uint8_t>(b), format);
    uint32_t u = 0;
    std::memcpy(&u, &v, sizeof u);
    table[b] = static_cast<uint16_t>(u >> 16);
  }
  at::Tensor out = at::empty(bytes.sizes(), at::TensorOptions().dtype(at::kBFloat16));
  const auto* in = static_cast<const uint8_t*>(bytes.data_ptr());
  auto* to = static_cast<uint16_t*>(out.data_ptr());
  const int64_t n = bytes.numel();
  for (int64_t i = 0; i < n; ++i) to[i] = table[in[i]];
  return out;
}

bool valid_bools(const at::Tensor& t) {
  const auto* b = static_cast<const unsigned char*>(t.data_ptr());
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i)
    if (b[i] > 1) return false;
  return true;
}

}  // namespace fusebox::detail
