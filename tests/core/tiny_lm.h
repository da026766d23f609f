// A tiny language model written with plain ATen ops, for exactness tests of the step modes:
// a tied embedding / output head, linear layers with biases, layer norms, a residual path and
// (optionally) a parameter that never receives a gradient. Lives on the test device
// (FUSEBOX_TEST_DEVICE, default cpu).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "../test_device.h"
#include "fusebox/optimizer.h"

namespace fusebox::testing {

struct TinyLm {
  static constexpr int64_t V = 17, D = 8, H = 12, B = 4, T = 5;
  std::vector<std::string> names{"embed.weight", "fc1.weight", "fc1.bias",
                                 "ln1.weight",   "ln1.bias",   "fc2.weight",
                                 "fc2.bias",     "ln2.weight", "ln2.bias"};
  std::vector<at::Tensor> params;

  explicit TinyLm(at::ScalarType dtype = at::kDouble, bool with_unused = false, uint64_t seed = 0) {
    at::manual_seed(seed);
    auto o = at::TensorOptions().dtype(dtype).device(test_device());
    params = {at::randn({V, D}, o) * 0.5,  at::randn({D, H}, o) * 0.3,  at::randn({H}, o) * 0.1,
              1 + at::randn({H}, o) * 0.1, at::randn({H}, o) * 0.1,     at::randn({H, D}, o) * 0.3,
              at::randn({D}, o) * 0.1,     1 + at::randn({D}, o) * 0.1, at::randn({D}, o) * 0.1};
    if (with_unused) {
      params.push_back(at::randn({3, 3}, o));
      names.push_back("unused.weight");
    }
    for (auto& p : params) p = p.detach().requires_grad_(true);
  }

  /// A deep copy with the same values, as separate leaves.
  TinyLm clone() const {
    TinyLm c = *this;
    for (auto& p : c.params) p = p.detach().clone().requires_grad_(true);
    return c;
  }

  /// One group holding every parameter with its name.
  std::vector<ParamGroup> groups(double lr = 0.05) const {
    ParamGroup g;
    g.params = params;
    g.names = names;
    g.lr = lr;
    return {g};
  }

  /// Cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (batch `step` of a fixed
  /// pseudo-random stream).
  at::Tensor loss(int64_t step) const { return loss(step, 0, B); }

  /// The same loss over rows [first, first + rows) of the batch (one data-parallel shard).
  at::Tensor loss(int64_t step, int64_t first, int64_t rows) const {
    at::Tensor tokens =
        at::arange(B * (T + 1), params[0].options().dtype(at::kLong)).reshape({B, T + 1});
    tokens = ((tokens * (7 + step) + 3 * step) % V).narrow(0, first, rows);
    at::Tensor in = tokens.narrow(1, 0, T), target = tokens.narrow(1, 1, T);
    const at::Tensor& E = params[0];
    at::Tensor x = at::embedding(E, in);
    at::Tensor h = at::gelu(at::matmul(x, params[1]) + params[2]);
    h = at::layer_norm(h, {H}, params[3], params[4]);
    at::Tensor y = at::matmul(h, params[5]) + params[6] + x;
    y = at::layer_norm(y, {D}, params[7], params[8]);
    at::Tensor logits = at::matmul(y, E.t());  // tied output head
    return at::cross_entropy_loss(logits.reshape({rows * T, V}), target.reshape({rows * T}));
  }
};

}  // namespace fusebox::testing
