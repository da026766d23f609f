// Low-precision parameters: fp32 math and state, round-to-nearest write-back by default,
// stochastic rounding for bf16 when asked.
#include "fusebox/update_math.h"
#include "plugin_test_support.h"

namespace {

std::vector<std::pair<std::string, fbt::Args>> all_configs() {
  auto c = fbt::per_param_configs();
  for (const auto& a : fbt::auto_lr_configs()) c.push_back(a);
  return c;
}

bool low_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

TEST(Precision, EveryDtypeStepsAndKeepsFp32StateForLowPrecision) {
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16, at::kFloat, at::kDouble})
    for (const auto& [file, args] : all_configs()) {
      SCOPED_TRACE(fbt::label(file, args) + " " + c10::toString(dtype));
      at::manual_seed(3);
      std::vector<at::Tensor> init = {at::randn({6, 8}).to(dtype), at::randn({8}).to(dtype)};
      auto params = fbt::leaf_copies(init);
      auto opt = fbt::make(file, params, args);
      for (int s = 0; s < 3; ++s) {
        fbt::set_grads(params, {at::randn({6, 8}), at::randn({8})});
        ASSERT_NO_THROW(opt->step());
      }
      const at::ScalarType state_type = low_precision(dtype) ? at::kFloat : dtype;
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_EQ(params[i].scalar_type(), dtype);
        EXPECT_TRUE(params[i].isfinite().all().item<bool>()) << i;
        // (Auto-LR first steps are ~d0 = 1e-6, below half an fp16/bf16 spacing: they round away.)
        if (!low_precision(dtype)) {
          EXPECT_FALSE(at::equal(params[i], init[i])) << "param " << i << " did not move";
        }
      }
      int state_tensors = 0;
      for (const auto& [key, t] : opt->state_dict()) {
        if (key.rfind("@optimizer/", 0) == 0 || key.size() < 5 ||
            key.compare(key.size() - 5, 5, "/step") == 0 ||
            key.find("/@param") != std::string::npos)
          continue;  // the SDK's own: step counts, global scalars, the parameter's signature
        // adamw8bit's 8-bit moments are byte codes (their block scales are float state).
        const bool codes = key.size() > 6 && key.compare(key.size() - 6, 6, "_codes") == 0;
        EXPECT_EQ(t.scalar_type(), codes ? at::kByte : state_type) << key;
        ++state_tensors;
      }
      EXPECT_GT(state_tensors, 0);
    }
}

// With round-to-nearest, one step of a low-precision parameter is the fp32 step from the same
// (exactly representable) values, rounded once: the math really is fp32.
TEST(Precision, OneLowPrecisionStepIsTheRoundedFp32Step) {
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16})
    for (const auto& [file, args] : all_configs()) {
      SCOPED_TRACE(fbt::label(file, args) + " " + c10::toString(dtype));
      at::manual_seed(5);
      std::vector<at::Tensor> low = {at::randn({6, 8}).to(dtype), at::randn({8}).to(dtype)};
      std::vector<at::Tensor> grads = {at::randn({6, 8}).to(dtype), at::randn({8}).to(dtype)};
      auto lp = fbt::leaf_copies(low);
      auto fp = fbt::leaf_copies({low[0].to(at::kFloat), low[1].to(at::kFloat)});
      auto opt_lp = fbt::make(file, lp, args), opt_fp = fbt::make(file, fp, args);
      fbt::set_grads(lp, grads);
      fbt::set_grads(fp, grads);
      opt_lp->step();
      opt_fp->step();
      for (size_t i = 0; i < lp.size(); ++i)
        EXPECT_TRUE(at::equal(lp[i], fp[i].to(dtype))) << "param " << i;
    }
}

// ---- Stochastic rounding ------------------------------------------------------------------

// bf16 has 8 significant bits: just below 1.0 the spacing is 2^-8.
constexpr double kUlpBelowOne = 1.0 / 256;

// Mean of `n` stochastic roundings of the fp32 value `x` to bf16.
double mean_of_roundings(double x, int64_t n) {
  at::Tensor src = at::full({n}, x, at::kFloat);
  at::Tensor dst = at::empty({n}, at::kBFloat16);
  fusebox::copy_stochastic_(dst, src);
  return dst.to(at::kDouble).mean().item<double>();
}

// Each draw is one of the two neighbours lo < x < hi = lo + ulp, the upper with probability
// p = (x - lo) / ulp, so the mean of n draws has standard deviation ulp·sqrt(p(1-p)/n) <=
// ulp / (2 sqrt(n)). With n = 2^18 that is ulp/1024; we allow 6 of those (a false alarm
// probability of about 2e-9 for an unseeded run; the run is seeded, so it is also repeatable).
// Round-to-nearest misses by up to ulp/2 = 512 of those units, so the test tells them apart.
TEST(StochasticRounding, MeanOfDrawsIsUnbiased) {
  at::manual_seed(1234);
  const int64_t n = 1 << 18;
  const double tol = 6 * kUlpBelowOne / (2 * std::sqrt(static_cast<double>(n)));
  for (double frac : {0.1, 0.3, 0.5, 0.77, 0.95})
    for (double sign : {1.0, -1.0}) {
      const double x = sign * (1.0 - kUlpBelowOne + frac * kUlpBelowOne);  // in [1 - ulp, 1)
      const double nearest = at::scalar_tensor(x, at::kFloat).to(at::kBFloat16).item<double>();
      EXPECT_NEAR(mean_of_roundings(x, n), x, tol) << "x = " << x;
      if (frac != 0.5) {
        EXPECT_GT(std::abs(nearest - x), 2 * tol) << "x = " << x;  // would catch nearest
      }
    }
}

TEST(StochasticRounding, ValuesOnTheBf16GridStayExact) {
  at::manual_seed(99);
  at::Tensor grid = at::randn({1 << 16}).to(at::kBFloat16);
  grid.index_put_({at::indexing::Slice(0, 4)},
                  at::tensor({0.0f, -0.0f, 1.0f, -2.0f}).to(at::kBFloat16));
  at::Tensor dst = at::empty_like(grid);
  for (int i = 0; i < 8; ++i) {
    fusebox::copy_stochastic_(dst, grid.to(at::kFloat));
    ASSERT_TRUE(at::equal(dst, grid));
  }
}

TEST(StochasticRounding, ReproducibleWithASeed) {
  at::Tensor src = at::rand({4096}) * 3;
  auto draw = [&](int64_t seed) {
    at::manual_seed(seed);
    at::Tensor dst = at::empty({4096}, at::kBFloat16);
    fusebox::copy_stochastic_(dst, src);
    return dst;
  };
  EXPECT_TRUE(at::equal(draw(42), draw(42)));
  EXPECT_FALSE(at::equal(draw(42), draw(43)));
}

// Through a plugin: an SGD step smaller than half a bf16 spacing is lost by round-to-nearest,
// and kept on average by stochastic rounding (same tolerance argument as above).
TEST(StochasticRounding, SgdKeepsSubUlpUpdatesOnAverage) {
  const int64_t n = 1 << 18;
  const double tol = 6 * kUlpBelowOne / (2 * std::sqrt(static_cast<double>(n)));
  const double update = 0.3 * kUlpBelowOne;
  for (const char* sr : {"false", "true"}) {
    at::manual_seed(2024);
    auto params = fbt::leaf_copies({at::ones({n}, at::kBFloat16)});
    auto opt = fbt::make("sgd.so", params, {{"lr", "1"}, {"stochastic_rounding", sr}});
    fbt::set_grads(params, {at::full({n}, update, at::kFloat)});
    opt->step();
    const double mean = params[0].detach().to(at::kDouble).mean().item<double>();
    if (std::string(sr) == "true")
      EXPECT_NEAR(mean, 1.0 - update, tol);
    else
      EXPECT_EQ(mean, 1.0);  // every element rounded back to 1
  }
}

TEST(StochasticRounding, EveryPluginHonoursTheFlag) {
  for (const auto& [file, base] : all_configs()) {
    SCOPED_TRACE(fbt::label(file, base));
    const auto* spec = fbt::plugin(file)->schema().find("stochastic_rounding");
    ASSERT_NE(spec, nullptr);
    EXPECT_EQ(spec->type, fusebox::ParamType::Bool);
    EXPECT_EQ(std::get<bool>(spec->default_value), false);
    auto run = [&, file = file, base = base](bool sr, int64_t seed) {
      fbt::Args args = base;
      args["stochastic_rounding"] = sr ? "true" : "false";
      at::manual_seed(17);
      auto params = fbt::leaf_copies({at::randn({64, 64}).to(at::kBFloat16)});
      const auto grads = std::vector<at::Tensor>{at::randn({64, 64})};
      auto opt = fbt::make(file, params, args);
      at::manual_seed(seed);
      fbt::set_grads(params, grads);
      opt->step();
      return params[0].detach();
    };
    const at::Tensor nearest = run(false, 1), a = run(true, 1), b = run(true, 1), c = run(true, 2);
    EXPECT_FALSE(at::equal(nearest, a)) << "stochastic rounding had no effect";
    EXPECT_TRUE(at::equal(a, b)) << "same seed, different result";
    EXPECT_FALSE(at::equal(a, c)) << "different seeds, same result";
    // Each stochastically rounded value is one of the two bf16 neighbours of the exact result,
    // so it is within one spacing of the round-to-nearest one.
    const at::Tensor diff = (a.to(at::kFloat) - nearest.to(at::kFloat)).abs();
    const at::Tensor spacing = nearest.to(at::kFloat).abs() * std::ldexp(1.0, -7);
    EXPECT_TRUE((diff <= spacing + 1e-30).all().item<bool>());
  }
}

}  // namespace
