// fusebox SDK: small numeric helpers shared by optimizer plugins, so none re-implements them.
// Every helper is device-agnostic and keeps scalars on the tensor's device (no host sync).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

namespace fusebox {

/// Root mean square of `x` as a 0-d tensor: ||x||_2 / sqrt(numel).
inline at::Tensor rms(const at::Tensor& x) {
  return x.norm() / std::sqrt(static_cast<double>(x.numel()));
}

/// 1 - beta^step, the usual Adam-style bias correction.
inline double bias_correction(double beta, int64_t step) {
  return 1.0 - std::pow(beta, static_cast<double>(step));
}

/// True for fp16 and bf16, whose updates are computed in fp32 and copied back.
inline bool is_low_precision(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

/// The fp32 working copy of a low-precision tensor, or the tensor itself otherwise.
inline at::Tensor fp32_view(const at::Tensor& t) {
  return is_low_precision(t) ? t.to(at::kFloat) : t;
}

/// Writes fp32 `src` into bf16 `dst` with stochastic rounding: a uniform integer in [0, 2^16) is
/// added to the fp32 bit pattern and the low 16 bits are cleared, which rounds up with probability
/// equal to the discarded fraction (unbiased in expectation; exact values stay exact).
/// Draws from the default generator of `src`'s device, so a seeded run is reproducible.
inline void copy_stochastic_(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.scalar_type() == at::kBFloat16 && src.scalar_type() == at::kFloat,
              "copy_stochastic_ needs a bf16 destination and an fp32 source");
  at::Tensor bits = src.contiguous().view(at::kInt);
  at::Tensor noise = at::randint_like(bits, 0, 1 << 16);
  at::Tensor rounded = (bits + noise).bitwise_and_(static_cast<int64_t>(-65536));
  dst.copy_(rounded.view(at::kFloat));
}

/// Writes the fp32 result `work` back into `param` if `param` is low precision: by stochastic
/// rounding for bf16 when `stochastic`, else round-to-nearest. No-op when `work` is `param`.
inline void write_back(const at::Tensor& param, const at::Tensor& work, bool stochastic) {
  if (work.is_same(param)) return;
  if (stochastic && param.scalar_type() == at::kBFloat16)
    copy_stochastic_(param, work);
  else
    param.copy_(work);
}

}  // namespace fusebox
