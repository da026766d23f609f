// Activation checkpointing: the same gradients and updates as without it, in every step mode,
// with random numbers and autocast inside a segment; less activation memory; a tensor the segment
// uses without declaring it is an error, not a silently missing gradient. On the test device
// (FUSEBOX_TEST_DEVICE), but for the memory test, which counts CPU tensors.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../test_device.h"
#include "fusebox/core/activation_checkpoint.h"
#include "fusebox/core/autocast.h"
#include "fusebox/core/memory_tracker.h"
#include "fusebox/core/plugin_registry.h"
#include "fusebox/core/step_mode.h"
#include "fusebox/error.h"
#include "plugin_args.h"

using namespace fusebox;
using fusebox::testing::test_device;

namespace {

// A chain of `depth` blocks x -> x + tanh(x W_i + b_i) (with dropout when `dropout` > 0), then a
// squared-error loss. Parameters: W_0, b_0, W_1, b_1, ...
struct Chain {
  int64_t width, depth;
  double dropout = 0;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;

  Chain(int64_t width, int64_t depth, at::ScalarType dtype = at::kFloat,
        at::Device device = test_device())
      : width(width), depth(depth) {
    at::manual_seed(7);
    const auto o = at::TensorOptions().dtype(dtype).device(device);
    for (int64_t i = 0; i < depth; ++i) {
      params.push_back((at::randn({width, width}, o) * 0.3).requires_grad_());
      params.push_back((at::randn({width}, o) * 0.1).requires_grad_());
      names.push_back("block" + std::to_string(i) + ".weight");
      names.push_back("block" + std::to_string(i) + ".bias");
    }
  }
  Chain clone() const {
    Chain c = *this;
    for (auto& p : c.params) p = p.detach().clone().requires_grad_();
    return c;
  }
  std::vector<ParamGroup> groups() const {
    ParamGroup g;
    g.params = params;
    g.names = names;
    g.lr = 0.01;
    return {g};
  }
  at::Tensor block(int64_t i, const at::Tensor& x) const {
    at::Tensor h = at::tanh(at::matmul(x, params[2 * i]) + params[2 * i + 1]);
    if (dropout > 0) h = at::dropout(h, dropout, /*train=*/true);
    return x + h;
  }
  at::Tensor loss(const at::Tensor& input, bool checkpointed) const {
    at::Tensor x = input;
    for (int64_t i = 0; i < depth; ++i) {
      if (!checkpointed) {
        x = block(i, x);
        continue;
      }
      x = recompute_in_backward(
          [this, i](const std::vector<at::Tensor>& in) { return block(i, in[0]); }, {x},
          {params[2 * i], params[2 * i + 1]});
    }
    return x.pow(2).mean();
  }
};

at::Tensor batch(int64_t step, int64_t width, at::ScalarType dtype = at::kFloat,
                 at::Device device = test_device()) {
  at::manual_seed(100 + step);
  return at::randn({16, width}, at::TensorOptions().dtype(dtype).device(device));
}

std::vector<at::Tensor> grads_of(const Chain& c) {
  std::vector<at::Tensor> g;
  for (const auto& p : c.params) g.push_back(p.grad().clone());
  return g;
}

void expect_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(at::equal(a[i], b[i]))
        << what << ": tensor " << i << " differs by " << (a[i] - b[i]).abs().max().item<double>();
}

}  // namespace

TEST(ActivationCheckpoint, GradientsAreTheSameBitForBit) {
  const Chain plain(12, 4, at::kDouble);
  const Chain ckpt = plain.clone();
  const at::Tensor x = batch(0, 12, at::kDouble);  // an input that needs no gradient
  const at::Tensor l1 = plain.loss(x, false), l2 = ckpt.loss(x, true);
  EXPECT_TRUE(at::equal(l1, l2));
  l1.backward();
  l2.backward();
  expect_equal(grads_of(plain), grads_of(ckpt), "checkpointed");
  // An input that needs a gradient gets the same one too.
  const at::Tensor a = batch(1, 12, at::kDouble).requires_grad_(),
                   b = a.detach().clone().requires_grad_();
  plain.loss(a, false).backward();
  ckpt.loss(b, true).backward();
  EXPECT_TRUE(at::equal(a.grad(), b.grad()));
}

TEST(ActivationCheckpoint, EveryStepModeTrainsAsWithoutIt) {
  PluginRegistry reg(fusebox::testing::only({FUSEBOX_PLUGIN_DIR}));
  auto plugin = reg.load_by_name("adamw");
  const HyperParams hp = plugin->validate(fusebox::testing::args_for(*plugin));
  const Chain init(10, 3);
  auto train = [&](const std::string& mode, bool checkpointed) {
    Chain c = init.clone();
    StepOptions so;
    std::unique_ptr<StepMode> m = make_step_mode(
        {mode, 2, SplitPolicy::Count}, c.groups(),
        [&](std::vector<ParamGroup> g) { return plugin->create(std::move(g), hp); }, so);
    for (int64_t s = 0; s < 3; ++s) {
      m->backward(c.loss(batch(s, 10), checkpointed));
      m->step();
    }
    std::vector<at::Tensor> out;
    for (const auto& p : c.params) out.push_back(p.detach().clone());
    return out;
  };
  const auto reference = train("normal", false);
  EXPECT_FALSE(at::equal(reference[0], init.params[0].detach()));  // it did train
  for (const std::string mode : {"normal", "fused", "groups"}) {
    SCOPED_TRACE(mode);
    expect_equal(reference, train(mode, true), mode + " with checkpointing");
  }
}

TEST(ActivationCheckpoint, RandomNumbersAreReplayedAndTheStreamGoesOnUndisturbed) {
  Chain plain(8, 3);
  plain.dropout = 0.5;
  Chain ckpt = plain.clone();
  const at::Tensor x = batch(0, 8);
  at::manual_seed(5);
  plain.loss(x, false).backward();
  const at::Tensor next_plain = at::rand({4}, x.options());
  at::manual_seed(5);
  ckpt.loss(x, true).backward();
  const at::Tensor next_ckpt = at::rand({4}, x.options());
  expect_equal(grads_of(plain), grads_of(ckpt), "dropout");
  EXPECT_TRUE(at::equal(next_plain, next_ckpt));
}

TEST(ActivationCheckpoint, TheRecomputationRunsUnderTheForwardsAutocast) {
  const Chain plain(16, 2);
  const Chain ckpt = plain.clone();
  const at::Tensor x = batch(0, 16);
  at::Tensor l1, l2;
  {
    AutocastGuard bf16(true, test_device().type(), at::kBFloat16);
    l1 = plain.loss(x, false);
    l2 = ckpt.loss(x, true);
  }
  // Backward runs after the autocast scope has ended, as a training loop does.
  l1.to(at::kFloat).backward();
  l2.to(at::kFloat).backward();
  expect_equal(grads_of(plain), grads_of(ckpt), "bf16 autocast");
}

TEST(ActivationCheckpoint, KeepsOnlyTheSegmentsInputsForBackward) {
  memory::install_cpu_tracking();
  const Chain model(256, 8, at::kFloat, at::kCPU);
  auto peak_of = [&](bool checkpointed) {
    const at::Tensor x = batch(0, 256, at::kFloat, at::kCPU).repeat({32, 1});
    for (auto& p : model.params) p.mutable_grad().reset();
    const int64_t base = memory::current_bytes();
    memory::reset_peak();
    model.loss(x, checkpointed).backward();
    return memory::peak_bytes() - base;
  };
  const int64_t plain = peak_of(false), ckpt = peak_of(true);
  // Without checkpointing each block keeps its matmul output, tanh output and sum (512 x 256
  // floats each); with it each block keeps its input only, and one block's activations exist at a
  // time during backward.
  EXPECT_LT(ckpt, plain * 2 / 3) << "checkpointed peak " << ckpt << " bytes, plain " << plain;
}

TEST(ActivationCheckpoint, ATensorTheSegmentUsesWithoutDeclaringItIsAnError) {
  const Chain c(6, 1);
  const at::Tensor hidden = at::ones({6}, test_device()).requires_grad_();
  const at::Tensor x = batch(0, 6);
  at::Tensor y = recompute_in_backward(
      [&](const std::vector<at::Tensor>& in) { return c.block(0, in[0]) * hidden; }, {x},
      {c.params[0], c.params[1]});
  try {
    y.sum().backward();
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("neither one of its inputs nor one of its params"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(recompute_in_backward({}, {x}, {}), Error);
  EXPECT_THROW(recompute_in_backward([](const std::vector<at::Tensor>& in) { return in[0]; }, {x},
                                     {at::ones({2}, test_device())}),
               Error);
}

TEST(ActivationCheckpoint, WithoutGradientsTheSegmentJustRuns) {
  const Chain c(6, 2);
  const at::Tensor x = batch(0, 6);
  at::NoGradGuard no_grad;
  const at::Tensor y = c.loss(x, true);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(at::equal(y, c.loss(x, false)));
}

// A listed tensor that is computed from a parameter (a scaled weight, a slice) passes its
// gradient on to that parameter, as without checkpointing.
TEST(ActivationCheckpoint, AComputedParameterPassesItsGradientOn) {
  const at::Tensor w = at::randn({5, 5}, test_device()).requires_grad_();
  const at::Tensor w2 = w.detach().clone().requires_grad_();
  const at::Tensor x = at::randn({3, 5}, test_device());
  at::matmul(x, w * 0.5).tanh().sum().backward();
  const at::Tensor scaled = w2 * 0.5;
  recompute_in_backward(
      [&scaled](const std::vector<at::Tensor>& in) { return at::matmul(in[0], scaled).tanh(); },
      {x}, {scaled})
      .sum()
      .backward();
  ASSERT_TRUE(w2.grad().defined());
  EXPECT_TRUE(at::equal(w.grad(), w2.grad()));
}
