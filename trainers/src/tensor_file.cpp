#include "tensor_file.h"

#include <ATen/ATen.h>

#include "fusebox/core/checkpoint.h"
#include "fusebox/core/safetensors.h"
#include "launch.h"
#include "read_crash_guard.h"

namespace fusebox::trainer {

std::map<std::string, at::Tensor> read_tensor_file(const std::string& path, const std::string& head,
                                                   const std::string& crash_line, bool* mapped,
                                                   UnsignedTypes* unsigned_types) {
  // The safetensors reader checks every range itself. Mapped, not read: pages are read as they
  // are used and need not all be in memory at once.
  const bool safetensors = looks_like_safetensors(head) || is_safetensors_path(path);
  if (safetensors) {
    if (mapped) *mapped = true;
    return map_safetensors(path, nullptr, unsigned_types);
  }
  // A torch.save'd file is mapped too when its records can be viewed as they are.
  const ReadCrashGuard guard(error_line(crash_line));
  return load_model_weights(path, mapped);
}

bool all_finite(const at::Tensor& t) {
  bool finite = true;
  in_pieces(t, [&](const at::Tensor& piece) {
    finite = finite && at::isfinite(piece).all().item<bool>();
  });
  return finite;
}

}  // namespace fusebox::trainer
