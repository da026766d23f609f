// What the readers of tensor files (safetensors, .npy) share: refusing what is not a regular
// file, mapping a file into memory for tensors to view, widening the unsigned types LibTorch
// lacks, and checking the bytes of bools.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <memory>

namespace fusebox::detail {

/// Refuses a path that is not there or not a regular file (a folder, a pipe), naming it.
void require_regular_file(const std::filesystem::path& path);

/// A file mapped into memory copy-on-write (a tensor written in place changes this process's copy,
/// never the file), unmapped when the last tensor viewing it (holding the shared_ptr) is gone.
class MappedFile {
 public:
  /// Maps `path` (a regular file); throws Error naming `where` when it cannot.
  static std::shared_ptr<MappedFile> open(const std::filesystem::path& path,
                                          const std::string& where);
  MappedFile(void* base, uint64_t size) : base_(base), size_(size) {}
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  char* data() const { return static_cast<char*>(base_); }
  uint64_t size() const { return size_; }

 private:
  void* base_;
  uint64_t size_;
};

/// A tensor of `type` (int32 or int64) holding the values of `carrier`, the signed type of the
/// same width as the unsigned one the file holds (int16 for uint16, int32 for uint32): its
/// negative values are the unsigned ones at and above 2^(bits - 1).
at::Tensor widen_unsigned(const at::Tensor& carrier, at::ScalarType type);

/// The 8-bit float formats of safetensors' F8_E4M3 (float8_e4m3fn: no infinities, one NaN per
/// sign) and F8_E5M2 (IEEE-like, the top byte of a float16).
enum class Float8 { kNone, kE4M3, kE5M2 };

/// The value the 8-bit float `bits` of `format` stands for.
float float8_value(uint8_t bits, Float8 format);

/// A bfloat16 tensor holding the values of `bytes` (uint8, contiguous), 8-bit floats of `format`:
/// every such value is exact in bfloat16 (more exponent and mantissa bits), so nothing is rounded.
at::Tensor widen_float8(const at::Tensor& bytes, Float8 format);

/// True if every byte of the bool tensor `t` (contiguous in memory, as read from a file) is 0 or 1,
/// the only bytes a bool may hold: any other reads back as neither true nor false.
bool valid_bools(const at::Tensor& t);

}  // namespace fusebox::detail
