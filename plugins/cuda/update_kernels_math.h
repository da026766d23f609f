// Per-element math of the CUDA optimizer kernels, shared by the device code and the CPU tests.
//
// Every function here is plain C++ that nvcc compiles for both host and device, so
// tests/plugins/cuda_math_test.cpp runs exactly the arithmetic the kernels run, on the CPU, against
// the plugins' ATen path. Scalars are prepared in double on the host and rounded to float once, as
// ATen does when it multiplies a float tensor by a double scalar; the operation order of each line
// follows the ATen op it replaces (noted beside it). Division and square roots are IEEE in both
// (no fast-math), so host and device differ only where nvcc contracts a multiply-add into an FMA.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FUSEBOX_HD __host__ __device__ __forceinline__
#else
#define FUSEBOX_HD inline
#endif

namespace fusebox_plugins::cuda {

// ---- Adam / AdamW ---------------------------------------------------------------------------

/// The per-step scalars of one Adam/AdamW update (torch.optim semantics), rounded to float.
struct AdamScalars {
  float decay;  ///< AdamW: 1 - lr·wd (θ shrinks before the moments); Adam: 1
  float l2;     ///< Adam: wd (added to the gradient as wd·θ); AdamW: 0
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float sqrt_bias2;  ///< sqrt(1 - beta2^t)
  float eps;
  float neg_step;  ///< -lr / (1 - beta1^t)
  bool amsgrad;
};

/// Scalars of step `t` (1-based) as the plugin's ATen path rounds them.
inline AdamScalars make_adam_scalars(double lr, double beta1, double beta2, double eps,
                                     double weight_decay, bool decoupled, bool amsgrad, int64_t t) {
  const double td = static_cast<double>(t);
  AdamScalars s;
  s.decay = decoupled && weight_decay != 0 ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  s.l2 = decoupled ? 0.0f : static_cast<float>(weight_decay);
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.sqrt_bias2 = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, td)));
  s.eps = static_cast<float>(eps);
  s.neg_step = static_cast<float>(-lr / (1.0 - std::pow(beta1, td)));
  s.amsgrad = amsgrad;
  return s;
}

/// One element of an Adam/AdamW step, in place: parameter `p`, gradient `g`, moments `m`, `v` and
/// (AMSGrad) the running maximum `vmax`.
FUSEBOX_HD void adam_element(float& p, float g, float& m, float& v, float& vmax,
                             const AdamScalars& s) {
  if (s.l2 != 0.0f) g = g + s.l2 * p;           // g.add(p, wd)
  p = p * s.decay;                              // p.mul_(1 - lr·wd); ·1 is exact for Adam
  m = m * s.beta1 + s.one_minus_beta1 * g;      // m.mul_(b1).add_(g, 1 - b1)
  v = v * s.beta2 + s.one_minus_beta2 * g * g;  // v.mul_(b2).addcmul_(g, g, 1 - b2)
  float vhat = v;
  if (s.amsgrad) {
    vmax = vmax > v ? vmax : v;  // maximum_out(vmax, vmax, v)
    vhat = vmax;
  }
  const float denom = sqrtf(vhat) / s.sqrt_bias2 + s.eps;  // sqrt().div_(..).add_(eps)
  p = p + s.neg_step * m / denom;                          // p.addcdiv_(m, denom, -step)
}

// ---- Adafactor, factored second moment -------------------------------------------------------
//
// A parameter with >= 2 dims is viewed as [B, R, C] (R, C: its last two dims). The kernels run:
//   1. row[b,r] = ema(row, mean_c(g² + eps1)),  col[b,c] = ema(col, mean_r(g² + eps1))
//   2. rfac[b,r] = rsqrt(row / mean_r(row)),     cfac[b,c] = rsqrt(col)
//   3. sumsq = Σ u², u = rfac·cfac·g              (a block-wise reduction, no u stored)
//   4. u /= max(rms(u) / clip, 1); u *= α; m = ema(m, u) (beta1); θ = θ·(1 - wd·α) - u

/// The per-step scalars of one factored Adafactor update, rounded to float.
struct AdafactorScalars {
  float eps1;
  float beta2, one_minus_beta2;  ///< beta2 = 1 - t^decay_rate
  float sqrt_n;                  ///< sqrt(numel), rms = norm / sqrt_n
  float clip;
  float rho;  ///< the step size when α is not scaled by the parameter's RMS
  bool has_beta1;
  float beta1, one_minus_beta1;
  float neg_weight_decay;  ///< -wd (α-scaled decay: θ·(1 + α·(-wd)))
  float decay;             ///< 1 - wd·rho (unscaled decay)
  bool has_weight_decay;
};

inline AdafactorScalars make_adafactor_scalars(double eps1, double beta2, int64_t numel,
                                               double clip, double rho, double beta1,
                                               double weight_decay) {
  AdafactorScalars s;
  s.eps1 = static_cast<float>(eps1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.sqrt_n = static_cast<float>(std::sqrt(static_cast<double>(numel)));
  s.clip = static_cast<float>(clip);
  s.rho = static_cast<float>(rho);
  s.has_beta1 = beta1 >= 0;
  s.beta1 = static_cast<float>(beta1 >= 0 ? beta1 : 0.0);
  s.one_minus_beta1 = static_cast<float>(beta1 >= 0 ? 1.0 - beta1 : 0.0);
  s.neg_weight_decay = static_cast<float>(-weight_decay);
  s.decay = static_cast<float>(1.0 - weight_decay * rho);
  s.has_weight_decay = weight_decay != 0;
  return s;
}

/// g² + eps1, one term of the row and column means.
FUSEBOX_HD float adafactor_square(float g, float eps1) { return g * g + eps1; }  // square().add_()

/// Exponential moving average of a row or column statistic with this step's mean.
FUSEBOX_HD float adafactor_ema(float stat, float mean, const AdafactorScalars& s) {
  return stat * s.beta2 + s.one_minus_beta2 * mean;  // stat.mul_(b2).add_(mean, 1 - b2)
}

/// rsqrt(row / mean_r(row)), the row factor.
FUSEBOX_HD float adafactor_row_factor(float row, float row_mean) {
  return 1.0f / sqrtf(row / row_mean);  // row.div(mean).rsqrt_()
}

/// rsqrt(col), the column factor.
FUSEBOX_HD float adafactor_col_factor(float col) { return 1.0f / sqrtf(col); }

/// The unclipped update of one element.
FUSEBOX_HD float adafactor_raw_update(float g, float row_factor, float col_factor) {
  return (row_factor * col_factor) * g;  // mul_out(u, rfac, cfac); u.mul_(g)
}

/// max(rms(u) / clip, 1) from Σ u².
FUSEBOX_HD float adafactor_clip_divisor(float sumsq, const AdafactorScalars& s) {
  const float r = sqrtf(sumsq) / s.sqrt_n / s.clip;  // (u.norm() / sqrt(n) / clip)
  return r > 1.0f ? r : 1.0f;                        // .clamp_min_(1)
}

/// One element of the final step, in place: parameter `p` and (beta1) first moment `m`, from the
/// unclipped update `u`, the clip divisor and the step size `alpha`.
FUSEBOX_HD void adafactor_apply(float& p, float& m, float u, float divisor, float alpha,
                                const AdafactorScalars& s) {
  u = u / divisor;  // u.div_(divisor)
  u = u * alpha;    // u.mul_(alpha)
  if (s.has_beta1) {
    m = m * s.beta1 + s.one_minus_beta1 * u;  // exp_avg.mul_(b1).add_(u, 1 - b1)
    u = m;
  }
  if (s.has_weight_decay) p = p * (alpha * s.neg_weight_decay + 1.0f);  // alpha.mul(-wd).add_(1)
  p = p - u;                                                            // p.sub_(u)
}

/// Like adafactor_apply, for the unscaled step size (α = rho): the decay is 1 - wd·rho.
FUSEBOX_HD void adafactor_apply_unscaled(float& p, float& m, float u, float divisor,
                                         const AdafactorScalars& s) {
  u = u / divisor;
  u = u * s.rho;  // u.mul_(rho)
  if (s.has_beta1) {
    m = m * s.beta1 + s.one_minus_beta1 * u;
    u = m;
  }
  if (s.has_weight_decay) p = p * s.decay;  // p.mul_(1 - wd·rho)
  p = p - u;
}

// ---- Index arithmetic -----------------------------------------------------------------------

/// Division by a fixed divisor d in [1, 2^31) through a multiply-high and a shift, for dividends
/// below 2^31 (Granlund & Montgomery): q = (umulhi(n, m) + n) >> s.
struct FastDivider {
  uint32_t divisor, multiplier, shift;
};

inline FastDivider make_fast_divider(uint32_t d) {
  uint32_t s = 0;
  while ((uint64_t{1} << s) < d) ++s;
  const uint64_t m = ((uint64_t{1} << 32) * ((uint64_t{1} << s) - d)) / d + 1;
  return {d, static_cast<uint32_t>(m), s};
}

FUSEBOX_HD uint32_t fast_div(uint32_t n, const FastDivider& f) {
#if defined(__CUDA_ARCH__)
  const uint32_t hi = __umulhi(n, f.multiplier);
#else
  const uint32_t hi = static_cast<uint32_t>((uint64_t{n} * f.multiplier) >> 32);
#endif
  return (hi + n) >> f.shift;
}

}  // namespace fusebox_plugins::cuda
