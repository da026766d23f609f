// ParameterEma: the average's recurrence and warm-up, float32 averages of bf16 parameters, the
// swap that lends the parameters the average and gives them back bit for bit, and loading.
#include "fusebox/core/ema.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "fusebox/error.h"

namespace fusebox {
namespace {

std::vector<std::pair<std::string, at::Tensor>> named(std::vector<at::Tensor> ts) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < ts.size(); ++i) out.emplace_back("p" + std::to_string(i), ts[i]);
  return out;
}

}  // namespace

TEST(ParameterEma, FollowsTheRecurrenceWithItsWarmUp) {
  at::manual_seed(3);
  at::Tensor w = at::randn({4, 5}), b = at::randn({5});
  ParameterEma ema(named({w, b}), 0.5);
  at::Tensor avg_w = w.clone(), avg_b = b.clone();
  for (int t = 0; t < 10; ++t) {
    const double d = std::min(0.5, (1.0 + t) / (10.0 + t));
    EXPECT_EQ(ema.next_decay(), d);
    w.add_(at::randn({4, 5}));
    b.add_(at::randn({5}));
    ema.update();
    avg_w.mul_(d).add_(w, 1 - d);
    avg_b.mul_(d).add_(b, 1 - d);
    EXPECT_TRUE(at::equal(ema.averages().at("p0"), avg_w)) << "update " << t;
    EXPECT_TRUE(at::equal(ema.averages().at("p1"), avg_b)) << "update " << t;
  }
  EXPECT_EQ(ema.updates(), 10);
  EXPECT_EQ(ema.next_decay(), 0.5);  // past the warm-up: the decay itself
  EXPECT_FALSE(at::equal(ema.averages().at("p0"), w));
}

TEST(ParameterEma, AveragesReducedPrecisionParametersInFloat32) {
  at::Tensor p = at::full({8}, 1.0, at::kBFloat16);
  ParameterEma ema(named({p}), 0.999);
  EXPECT_EQ(ema.averages().at("p0").scalar_type(), at::kFloat);
  p.fill_(2.0);
  for (int i = 0; i < 20; ++i) ema.update();
  // A bf16 average would stall: 1 + (1 - d)·1 rounds back to 1 once 1 - d is small.
  const double v = ema.averages().at("p0")[0].item<double>();
  EXPECT_GT(v, 1.5);
  EXPECT_LT(v, 2.0);
  EXPECT_EQ(p.scalar_type(), at::kBFloat16);
}

// A swap lends the average to the parameter and gives the trained values back bit for bit, in
// the parameter's own storage. A float32 parameter trades storages with its average (nothing is
// allocated: the parameter's data is the average's own memory meanwhile); a bf16 one, averaged
// in float32, is copied.
TEST(ParameterEma, ASwapLendsTheAverageAndGivesTheParametersBackBitForBit) {
  at::manual_seed(5);
  at::Tensor w = at::randn({3, 3}).requires_grad_(true);
  at::Tensor h = at::randn({4}).to(at::kBFloat16).requires_grad_(true);
  ParameterEma ema(named({w, h}), 0.9);
  {
    at::NoGradGuard no_grad;
    w.add_(1.0);
    h.add_(1.0);
  }
  ema.update();
  const at::Tensor trained_w = w.detach().clone(), trained_h = h.detach().clone();
  const at::Tensor average_w = ema.averages().at("p0").clone();
  const at::Tensor average_h = ema.averages().at("p1").clone();
  const void* w_storage = w.data_ptr();
  const void* average_storage = ema.averages().at("p0").data_ptr();
  ASSERT_FALSE(at::equal(trained_w, average_w));
  {
    ParameterEma::Swap swap(ema);
    EXPECT_TRUE(at::equal(w.detach(), average_w));
    EXPECT_EQ(w.data_ptr(), average_storage) << "traded, not copied";
    EXPECT_TRUE(at::equal(ema.averages().at("p0"), trained_w)) << "kept by the average meanwhile";
    EXPECT_EQ(h.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(h.detach(), average_h.to(at::kBFloat16)));
    EXPECT_TRUE(w.requires_grad());
    EXPECT_TRUE(w.is_leaf());
  }
  EXPECT_TRUE(at::equal(w.detach(), trained_w));
  EXPECT_EQ(w.data_ptr(), w_storage) << "back in its own storage";
  EXPECT_TRUE(at::equal(h.detach(), trained_h));
  EXPECT_TRUE(at::equal(ema.averages().at("p0"), average_w));
  EXPECT_TRUE(at::equal(ema.averages().at("p1"), average_h));
  // The average goes on from where it was: the next update is the one a swap never touched.
  const double d = ema.next_decay();
  ema.update();
  EXPECT_TRUE(at::equal(ema.averages().at("p0"), average_w.mul(d).add(trained_w, 1 - d)));
}

TEST(ParameterEma, LoadRestoresAndRefusesAnotherModelsAverages) {
  at::Tensor w = at::randn({2, 3});
  ParameterEma ema(named({w}), 0.9);
  const at::Tensor before = ema.averages().at("p0").clone();
  auto error_of = [&](const std::map<std::string, at::Tensor>& saved, int64_t updates) {
    try {
      ema.load(saved, updates);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of({{"q", at::zeros({2, 3})}}, 1).find("no entry for parameter 'p0'"),
            std::string::npos);
  EXPECT_NE(error_of({{"p0", at::zeros({3, 2})}}, 1).find("the saved average of 'p0' is"),
            std::string::npos);
  EXPECT_NE(error_of({{"p0", at::zeros({2, 3}, at::kDouble)}}, 1).find("another model or dtype"),
            std::string::npos);
  EXPECT_NE(error_of({{"p0", at::zeros({2, 3})}, {"extra", at::zeros({1})}}, 1)
                .find("'extra' that is no parameter"),
            std::string::npos);
  EXPECT_TRUE(at::equal(ema.averages().at("p0"), before)) << "a refused load changed nothing";
  EXPECT_EQ(ema.updates(), 0);
  ema.load({{"p0", at::ones({2, 3})}}, 7);
  EXPECT_TRUE(at::equal(ema.averages().at("p0"), at::ones({2, 3})));
  EXPECT_EQ(ema.updates(), 7);
  EXPECT_THROW(ParameterEma(named({w}), 1.0), Error);
  EXPECT_THROW(ParameterEma(named({w}), 0.0), Error);
}

}  // namespace fusebox
