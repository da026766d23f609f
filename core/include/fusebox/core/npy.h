// NumPy's .npy format (np.save): a magic string, a version, a header that is a Python dict literal
// ({'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }) padded with spaces, then the
// array's raw bytes. One array, no name. And .npz (np.savez): named .npy files in a zip archive.
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <string>

#include "fusebox/core/safetensors.h"

namespace fusebox {

/// The array of a .npy file, mapped into memory as map_safetensors maps (copy-on-write; the file
/// must not be shortened while mapped): a tensor viewing the file's bytes, with Fortran-ordered
/// arrays viewed with column-major strides. Little-endian float64/32/16, int64/32/16/8, uint8 and
/// bool are read as they are, uint16 and uint32 widened into int32 and int64 (copied); big-endian,
/// structured and object arrays, and other types are refused. Throws Error naming the file and the
/// fault (a truncated file, a malformed header, a bool that is not 0 or 1). With `unsigned_type`,
/// uint16 and uint32 are kept as they lie, as map_safetensors keeps U16/U32: the array in its
/// signed carrier type (viewed), and `*unsigned_type` the type widen_unsigned() makes of it
/// (Undefined for other arrays).
at::Tensor map_npy(const std::filesystem::path& path, at::ScalarType* unsigned_type = nullptr);

/// The same for a file's bytes in memory (copied into the tensor); `where` names them in errors.
at::Tensor parse_npy(const std::string& bytes, const std::string& where);

/// A headerless file of little-endian values of one type, as numpy's `array.tofile(path)` or an
/// np.memmap writes it (nanoGPT's train.bin of uint16 token ids): a one-dimensional tensor viewing
/// the mapped file. `dtype` is numpy's name of the type: "uint16", "uint32", "int16", "int32",
/// "int64", "uint8", "int8", "float32", "float64"; uint16 and uint32 as map_npy reads them
/// (`unsigned_type`). Throws Error naming the file when it is empty or its size is not a whole
/// number of values, and for another `dtype`.
at::Tensor map_raw_array(const std::filesystem::path& path, const std::string& dtype,
                         at::ScalarType* unsigned_type = nullptr);

/// True if `head`, a file's first bytes, starts with .npy's magic string ("\x93NUMPY").
bool looks_like_npy(const std::string& head);

/// The arrays of a NumPy .npz archive (np.savez: a zip archive of .npy files), by name (the file
/// name without ".npy"), each read as map_npy reads one: np.savez stores the arrays as they are,
/// so a tensor views its bytes in the mapped archive when they are aligned for its type, and is
/// copied when not (np.savez does not align them). np.savez_compressed deflates them: each is
/// inflated into memory of its own (its size and CRC-32 checked), when zlib_available().
/// ZIP64 archives are read; encrypted or multi-disk archives, other compression methods, entries
/// that are not .npy files and entries whose ranges leave the file are refused with Error naming
/// the file and the fault. Stored entries' CRCs are not checked (that would read every byte).
/// `unsigned_types` as for map_npy, by array name.
std::map<std::string, at::Tensor> map_npz(const std::filesystem::path& path,
                                          UnsignedTypes* unsigned_types = nullptr);

/// The same for an archive's bytes in memory (copied into the tensors).
std::map<std::string, at::Tensor> parse_npz(const std::string& bytes, const std::string& where);

/// True if `head`, a file's first bytes (at least 30 + the first entry's name), starts like an
/// .npz archive: a zip archive whose first entry is a .npy file.
bool looks_like_npz(const std::string& head);

}  // namespace fusebox
