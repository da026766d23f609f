// The bench model: a chain of linear layers with GELU. Uniform: many parameter tensors of
// similar size (the fused case); uneven: a few large tensors at the front followed by many small
// ones (where splitting by count is unfair).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "fusebox/optimizer.h"

namespace fusebox::bench {

struct ChainModel {
  std::vector<at::Tensor> weights;
  std::vector<std::string> names;
  int64_t batch;
  at::Device device = at::kCPU;
  /// The weights are drawn on the CPU, then moved, so every device trains the same model.
  ChainModel(int64_t width, int64_t depth, int64_t batch_size, bool uneven,
             at::Device on = at::kCPU)
      : batch(batch_size), device(on) {
    at::manual_seed(0);
    std::vector<int64_t> dims(static_cast<size_t>(depth + 1), width);
    if (uneven) dims[1] = dims[2] = dims[3] = 4 * width;  // layers 0-3: 4x/16x/16x/4x
    for (int64_t i = 0; i < depth; ++i) {
      const int64_t in = dims[static_cast<size_t>(i)], out = dims[static_cast<size_t>(i + 1)];
      weights.push_back((at::randn({in, out}) / std::sqrt(static_cast<double>(in)))
                            .to(device)
                            .requires_grad_(true));
      names.push_back("layer" + std::to_string(i) + ".weight");
    }
  }
  /// A copy with the same values, as separate leaves.
  ChainModel clone() const {
    ChainModel m = *this;
    for (auto& w : m.weights) w = w.detach().clone().requires_grad_(true);
    return m;
  }
  int64_t param_bytes() const {
    int64_t b = 0;
    for (auto& w : weights) b += w.numel() * w.element_size();
    return b;
  }
  int64_t largest_bytes() const {
    int64_t b = 0;
    for (auto& w : weights) b = std::max<int64_t>(b, w.numel() * w.element_size());
    return b;
  }
  /// Loss of batch `step`.
  at::Tensor loss(int64_t step) const { return loss(step, 0, batch); }
  /// The same loss over rows [first, first + rows) of the batch (one data-parallel shard: the
  /// mean over ranks of the shards' gradients is the whole batch's gradient).
  at::Tensor loss(int64_t step, int64_t first, int64_t rows) const {
    at::Tensor x = at::sin(at::arange(batch * weights[0].size(0),
                                      at::TensorOptions(at::kFloat).device(device)) *
                           (0.01 + step))
                       .reshape({batch, weights[0].size(0)})
                       .narrow(0, first, rows);
    for (auto& w : weights) x = at::gelu(at::matmul(x, w));
    return x.square().mean();
  }
  std::vector<ParamGroup> groups() const {
    ParamGroup g;
    g.params = weights;
    g.names = names;
    g.lr = 1e-4;
    return {g};
  }
};

}  // namespace fusebox::bench
