// Files of named tensors the trainer reads (--init-weights, --dataset tensors:): one way to read
// them, and one way to check their values, for both.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>

#include "fusebox/core/safetensors.h"

namespace fusebox::trainer {

/// The tensors of the file at `path`, whose first bytes are `head` (read_file_head): a safetensors
/// file (told by its bytes or its name) is mapped into memory (map_safetensors), anything else is
/// read as torch.save's {name: tensor} dict under a ReadCrashGuard whose line is `crash_line`
/// (LibTorch's reader may crash on a malformed file), mapped too when its records can be viewed
/// as they are. `mapped`, when given, says whether the tensors view the mapped file;
/// `unsigned_types`, when given, keeps a safetensors file's U16/U32 tensors unwidened
/// (map_safetensors).
std::map<std::string, at::Tensor> read_tensor_file(const std::string& path, const std::string& head,
                                                   const std::string& crash_line,
                                                   bool* mapped = nullptr,
                                                   UnsignedTypes* unsigned_types = nullptr);

/// Calls `check` on consecutive pieces of `t`, flattened: whole rows (first-dimension slices) of
/// about 2^22 elements, at least one row, so that checking a file larger than memory makes no
/// temporary of its size, even for a view that is not contiguous (windows of a token stream,
/// which overlap: flattening the whole view would copy it).
template <class Check>
void in_pieces(const at::Tensor& t, Check check) {
  if (t.numel() == 0) return;
  if (t.dim() == 0) return check(t.reshape({-1}));
  constexpr int64_t kPiece = int64_t{1} << 22;
  const int64_t rows = std::max<int64_t>(1, kPiece / (t.numel() / t.size(0)));
  for (int64_t i = 0; i < t.size(0); i += rows)
    check(t.narrow(0, i, std::min(rows, t.size(0) - i)).reshape({-1}));
}

/// True if every value of the floating tensor `t` is finite (checked in_pieces).
bool all_finite(const at::Tensor& t);

}  // namespace fusebox::trainer
