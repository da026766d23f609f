// NumPy's .npy format (np.save): a magic string, a version, a header that is a Python dict literal
// ({'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }) padded with spaces, then the
// array's raw bytes. One array, no name.
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <string>

namespace fusebox {

/// The array of a .npy file, mapped into memory as map_safetensors maps (copy-on-write; the file
/// must not be shortened while mapped): a tensor viewing the file's bytes, with Fortran-ordered
/// arrays viewed with column-major strides. Little-endian float64/32/16, int64/32/16/8, uint8 and
/// bool are read as they are, uint16 and uint32 widened into int32 and int64 (copied); big-endian,
/// structured and object arrays, and other types are refused. Throws Error naming the file and the
/// fault (a truncated file, a malformed header, a bool that is not 0 or 1).
at::Tensor map_npy(const std::filesystem::path& path);

/// The same for a file's bytes in memory (copied into the tensor); `where` names them in errors.
at::Tensor parse_npy(const std::string& bytes, const std::string& where);

/// True if `head`, a file's first bytes, starts with .npy's magic string ("\x93NUMPY").
bool looks_like_npy(const std::string& head);

}  // namespace fusebox
