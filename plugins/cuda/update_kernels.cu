// The CUDA optimizer kernels: one fused pass for Adam/AdamW, four small launches for factored
// Adafactor. The arithmetic is in update_kernels_math.h, shared with the CPU tests.
#include <cuda_bf16.h>

#include <algorithm>

#include "update_kernels.h"

namespace fusebox_plugins::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int64_t kMaxBlocks = 8192;  // grid-stride loops cover the rest
constexpr int kPartials = 1024;       // blocks of the Σu² reduction, and its final block's size

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

/// Sum over the block (blockDim.x a multiple of 32, at most 1024); the result is valid in thread 0.
__device__ float block_sum(float v) {
  __shared__ float warps[kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_sum(v);
  __syncthreads();  // warps[] may still be read by a previous call
  if (lane == 0) warps[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / kWarp ? warps[lane] : 0.0f;
  return warp == 0 ? warp_sum(v) : 0.0f;
}

int blocks_for(int64_t work, int threads) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min(kMaxBlocks, (work + threads - 1) / threads)));
}

// ---- Adam ------------------------------------------------------------------------------------

template <typename P>
__global__ void adam_kernel(P* __restrict__ param, const P* __restrict__ grad,
                            float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                            float* __restrict__ max_exp_avg_sq, int64_t n, AdamScalars s) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float p = load(param, i), m = exp_avg[i], v = exp_avg_sq[i];
    float vmax = s.amsgrad ? max_exp_avg_sq[i] : 0.0f;
    adam_element(p, load(grad, i), m, v, vmax, s);
    store(param, i, p);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (s.amsgrad) max_exp_avg_sq[i] = vmax;
  }
}

// ---- Adafactor -------------------------------------------------------------------------------

/// Position of flat element i of [B, R, C]: its row br = b·R + r and its column entry bc = b·C + c.
/// 32-bit fast division when the tensor has fewer than 2^31 elements, 64-bit division otherwise.
struct FactoredIndex {
  FastDivider by_c, by_r;
  int64_t R, C;
  bool small;
};

__device__ __forceinline__ void locate(int64_t i, const FactoredIndex& ix, int64_t& br,
                                       int64_t& bc) {
  if (ix.small) {
    const uint32_t row = fast_div(static_cast<uint32_t>(i), ix.by_c);
    const uint32_t b = fast_div(row, ix.by_r);
    br = row;
    bc = static_cast<int64_t>(b) * ix.C + (static_cast<uint32_t>(i) - row * ix.by_c.divisor);
  } else {
    br = i / ix.C;
    bc = (br / ix.R) * ix.C + (i - br * ix.C);
  }
}

/// Row statistics: one warp per row of C elements.
template <typename P>
__global__ void adafactor_rows_kernel(const P* __restrict__ grad, float* __restrict__ row,
                                      int64_t rows, int64_t C, AdafactorScalars s) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; r < rows;
       r += warps) {
    const P* g = grad + r * C;
    float acc = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) acc += adafactor_square(load(g, c), s.eps1);
    acc = warp_sum(acc);
    if (lane == 0) row[r] = adafactor_ema(row[r], acc / static_cast<float>(C), s);
  }
}

/// Column statistics: a block of 32 x 8 threads per 32 columns of one b; the 8 rows of threads
/// stride over R and their sums meet in shared memory.
constexpr int kColY = 8;
template <typename P>
__global__ void adafactor_cols_kernel(const P* __restrict__ grad, float* __restrict__ col,
                                      int64_t B, int64_t R, int64_t C, AdafactorScalars s) {
  __shared__ float part[kColY][kWarp + 1];
  const int64_t tiles_per_b = (C + kWarp - 1) / kWarp;
  for (int64_t t = blockIdx.x; t < B * tiles_per_b; t += gridDim.x) {
    const int64_t b = t / tiles_per_b;
    const int64_t c = (t % tiles_per_b) * kWarp + threadIdx.x;
    float acc = 0.0f;
    if (c < C)
      for (int64_t r = threadIdx.y; r < R; r += kColY)
        acc += adafactor_square(load(grad, (b * R + r) * C + c), s.eps1);
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
      float sum = 0.0f;
      for (int y = 0; y < kColY; ++y) sum += part[y][threadIdx.x];
      col[b * C + c] = adafactor_ema(col[b * C + c], sum / static_cast<float>(R), s);
    }
    __syncthreads();
  }
}

/// Row and column factors: one warp per b (mean of its R row statistics, then the factors).
__global__ void adafactor_factors_kernel(const float* __restrict__ row,
                                         const float* __restrict__ col, float* __restrict__ rfac,
                                         float* __restrict__ cfac, int64_t B, int64_t R,
                                         int64_t C) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
  for (int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; b < B;
       b += warps) {
    float acc = 0.0f;
    for (int64_t r = lane; r < R; r += kWarp) acc += row[b * R + r];
    const float mean = __shfl_sync(0xffffffffu, warp_sum(acc), 0) / static_cast<float>(R);
    for (int64_t r = lane; r < R; r += kWarp)
      rfac[b * R + r] = adafactor_row_factor(row[b * R + r], mean);
    for (int64_t c = lane; c < C; c += kWarp)
      cfac[b * C + c] = adafactor_col_factor(col[b * C + c]);
  }
}

/// Σu² per block into partials[blockIdx.x] (gridDim.x <= kPartials).
template <typename P>
__global__ void adafactor_sumsq_kernel(const P* __restrict__ grad, const float* __restrict__ rfac,
                                       const float* __restrict__ cfac, int64_t n, FactoredIndex ix,
                                       float* __restrict__ partials) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  float acc = 0.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    int64_t br, bc;
    locate(i, ix, br, bc);
    const float u = adafactor_raw_update(load(grad, i), rfac[br], cfac[bc]);
    acc += u * u;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

/// Adds the `count` partial sums (count <= blockDim.x) into *out; one block.
__global__ void sum_partials_kernel(const float* __restrict__ partials, int count,
                                    float* __restrict__ out) {
  const float v = static_cast<int>(threadIdx.x) < count ? partials[threadIdx.x] : 0.0f;
  const float total = block_sum(v);
  if (threadIdx.x == 0) *out = total;
}

template <typename P>
__global__ void adafactor_apply_kernel(P* __restrict__ param, const P* __restrict__ grad,
                                       float* __restrict__ exp_avg, const float* __restrict__ rfac,
                                       const float* __restrict__ cfac,
                                       const float* __restrict__ sumsq,
                                       const float* __restrict__ alpha, int64_t n, FactoredIndex ix,
                                       AdafactorScalars s) {
  const float divisor = adafactor_clip_divisor(*sumsq, s);
  const float a = alpha ? *alpha : 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    int64_t br, bc;
    locate(i, ix, br, bc);
    const float u = adafactor_raw_update(load(grad, i), rfac[br], cfac[bc]);
    float p = load(param, i);
    float m = s.has_beta1 ? exp_avg[i] : 0.0f;
    if (alpha)
      adafactor_apply(p, m, u, divisor, a, s);
    else
      adafactor_apply_unscaled(p, m, u, divisor, s);
    store(param, i, p);
    if (s.has_beta1) exp_avg[i] = m;
  }
}

template <typename P>
cudaError_t adafactor_typed(P* param, const P* grad, float* row, float* col, float* exp_avg,
                            const float* alpha, int64_t B, int64_t R, int64_t C,
                            const AdafactorScalars& s, float* workspace, cudaStream_t stream) {
  const int64_t n = B * R * C;
  float* rfac = workspace;
  float* cfac = rfac + B * R;
  float* partials = cfac + B * C;
  float* sumsq = partials + kPartials;

  FactoredIndex ix{};
  ix.R = R;
  ix.C = C;
  ix.small = n < (int64_t{1} << 31);
  if (ix.small) {
    ix.by_c = make_fast_divider(static_cast<uint32_t>(C));
    ix.by_r = make_fast_divider(static_cast<uint32_t>(R));
  }

  adafactor_rows_kernel<<<blocks_for(B * R * kWarp, kThreads), kThreads, 0, stream>>>(grad, row,
                                                                                      B * R, C, s);
  const int64_t col_tiles = B * ((C + kWarp - 1) / kWarp);
  adafactor_cols_kernel<<<static_cast<int>(std::min(kMaxBlocks, col_tiles)), dim3(kWarp, kColY), 0,
                          stream>>>(grad, col, B, R, C, s);
  adafactor_factors_kernel<<<blocks_for(B * kWarp, kThreads), kThreads, 0, stream>>>(row, col, rfac,
                                                                                     cfac, B, R, C);
  const int partial_blocks = static_cast<int>(
      std::min<int64_t>(kPartials, std::max<int64_t>(1, (n + kThreads - 1) / kThreads)));
  adafactor_sumsq_kernel<<<partial_blocks, kThreads, 0, stream>>>(grad, rfac, cfac, n, ix,
                                                                  partials);
  sum_partials_kernel<<<1, kPartials, 0, stream>>>(partials, partial_blocks, sumsq);
  adafactor_apply_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      param, grad, exp_avg, rfac, cfac, sumsq, alpha, n, ix, s);
  return cudaGetLastError();
}

}  // namespace

cudaError_t adam_step(ParamType type, void* param, const void* grad, float* exp_avg,
                      float* exp_avg_sq, float* max_exp_avg_sq, int64_t n, const AdamScalars& s,
                      cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int blocks = blocks_for(n, kThreads);
  if (type == ParamType::kFloat32)
    adam_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<float*>(param),
                                                 static_cast<const float*>(grad), exp_avg,
                                                 exp_avg_sq, max_exp_avg_sq, n, s);
  else
    adam_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(param),
                                                 static_cast<const __nv_bfloat16*>(grad), exp_avg,
                                                 exp_avg_sq, max_exp_avg_sq, n, s);
  return cudaGetLastError();
}

size_t adafactor_workspace_floats(int64_t B, int64_t R, int64_t C) {
  return static_cast<size_t>(B * R + B * C + kPartials + 1);
}

cudaError_t adafactor_factored_step(ParamType type, void* param, const void* grad, float* row,
                                    float* col, float* exp_avg, const float* alpha, int64_t B,
                                    int64_t R, int64_t C, const AdafactorScalars& s,
                                    float* workspace, cudaStream_t stream) {
  if (B <= 0 || R <= 0 || C <= 0) return cudaSuccess;
  if (type == ParamType::kFloat32)
    return adafactor_typed(static_cast<float*>(param), static_cast<const float*>(grad), row, col,
                           exp_avg, alpha, B, R, C, s, workspace, stream);
  return adafactor_typed(static_cast<__nv_bfloat16*>(param),
                         static_cast<const __nv_bfloat16*>(grad), row, col, exp_avg, alpha, B, R, C,
                         s, workspace, stream);
}

}  // namespace fusebox_plugins::cuda
