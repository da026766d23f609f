// Raw CUDA kernels for the hottest per-parameter optimizer updates. They take device pointers,
// sizes, scalars and a stream, so they build with nvcc alone (no CUDA LibTorch needed); the
// plugins call them through cuda_dispatch.h. Every launcher returns the launch's cudaError_t.
//
// Layout: every tensor is dense and contiguous; state tensors are fp32; the parameter and its
// gradient share one dtype, fp32 or bf16 (bf16 is computed in fp32 and rounded to nearest).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "update_kernels_math.h"

namespace fusebox_plugins::cuda {

enum class ParamType { kFloat32, kBFloat16 };

/// One Adam/AdamW step over `n` elements: param and grad of `type`; exp_avg, exp_avg_sq and
/// (AMSGrad only, else null) max_exp_avg_sq fp32.
cudaError_t adam_step(ParamType type, void* param, const void* grad, float* exp_avg,
                      float* exp_avg_sq, float* max_exp_avg_sq, int64_t n, const AdamScalars& s,
                      cudaStream_t stream);

/// Scratch floats adafactor_factored_step needs for a [B, R, C] parameter.
size_t adafactor_workspace_floats(int64_t B, int64_t R, int64_t C);

/// One factored Adafactor step of a parameter viewed as [B, R, C]: updates the row [B, R] and
/// column [B, C] statistics, (beta1) the first moment, and the parameter. `alpha` is a device
/// pointer to the step size ρ·max(eps2, rms(θ)) when the step is scaled by the parameter's RMS,
/// or null to use s.rho. `workspace` holds adafactor_workspace_floats(B, R, C) floats.
cudaError_t adafactor_factored_step(ParamType type, void* param, const void* grad, float* row,
                                    float* col, float* exp_avg, const float* alpha, int64_t B,
                                    int64_t R, int64_t C, const AdafactorScalars& s,
                                    float* workspace, cudaStream_t stream);

}  // namespace fusebox_plugins::cuda
