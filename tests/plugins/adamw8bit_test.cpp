// adamw8bit: AdamW's update from moments stored in 8 bits. The generic plugin tests (step() =
// step_param(), state round trips, precision, groups) run it through plugin_test_support.h; these
// check what is its own: the state's layout and size, that it is AdamW exactly when nothing is
// quantized and close to it when everything is, that a tiny second moment never divides by eps
// alone, and that state saved with another block size goes on.
#include <cstdlib>

#include "plugin_test_support.h"

namespace {

// A regression problem: minimise |X·w - y|^2 over `params` (a matrix and a bias), gradients
// computed by hand so the test needs no autograd.
struct Regression {
  at::Tensor x = at::randn({64, 96}), y = at::randn({64, 48});
  std::vector<at::Tensor> grads(const std::vector<at::Tensor>& p) const {
    const at::Tensor r = (x.matmul(p[0]) + p[1] - y) / 64;
    return {x.t().matmul(r), r.sum(0)};
  }
};

std::vector<at::Tensor> train(const std::string& file, const fbt::Args& args, int steps,
                              std::shared_ptr<fusebox::Optimizer>* out = nullptr) {
  at::manual_seed(11);
  const Regression problem;
  std::vector<at::Tensor> params = fbt::leaf_copies({at::randn({96, 48}) * 0.1, at::zeros({48})});
  auto opt = fbt::make(file, params, args);
  for (int s = 0; s < steps; ++s) {
    fbt::set_grads(params, problem.grads(params));
    opt->step();
  }
  if (out) *out = opt;
  return params;
}

int64_t state_bytes(const fusebox::Optimizer& opt) {
  int64_t bytes = 0;
  for (const auto& [key, t] : opt.state_dict())
    if (key.find("/step") == std::string::npos && key.find("/@param") == std::string::npos &&
        key.rfind("@optimizer/", 0) != 0)
      bytes += t.numel() * t.element_size();
  return bytes;
}

TEST(AdamW8bit, NothingQuantizedIsAdamWBitForBit) {
  const fbt::Args args = {{"lr", "0.01"}, {"weight_decay", "0.1"}};
  fbt::Args whole = args;
  whole["min_8bit_size"] = "1000000";
  const auto a = train("adamw.so", args, 20), b = train("adamw8bit.so", whole, 20);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << i;
}

TEST(AdamW8bit, QuantizedMomentsTakeAQuarterAndTrackAdamW) {
  const fbt::Args args = {{"lr", "0.01"}, {"weight_decay", "0.1"}};
  std::shared_ptr<fusebox::Optimizer> full, small;
  const auto start = train("adamw.so", args, 0);
  const auto a = train("adamw.so", args, 50, &full), b = train("adamw8bit.so", args, 50, &small);
  // The 96x48 matrix is quantized (blocks of 256: 18 scales per moment); the bias is not.
  const fusebox::StateDict st = small->state_dict();
  EXPECT_EQ(st.at("g0.p0/exp_avg_codes").scalar_type(), at::kByte);
  EXPECT_EQ(st.at("g0.p0/exp_avg_codes").sizes(), (std::vector<int64_t>{18, 256}));
  EXPECT_EQ(st.at("g0.p0/exp_avg_sq_scale").sizes(), (std::vector<int64_t>{18}));
  EXPECT_EQ(st.count("g0.p0/exp_avg"), 0u);
  EXPECT_EQ(st.at("g0.p1/exp_avg").scalar_type(), at::kFloat);
  const double ratio = static_cast<double>(state_bytes(*small)) / state_bytes(*full);
  EXPECT_LT(ratio, 0.27);
  EXPECT_GT(ratio, 0.25);
  // 50 steps of lr 0.01 move the matrix by 10 (norm); the 8-bit run ends within 5% of that
  // distance from AdamW's (3.4% here: the rounding of the moments, not a drift of the method).
  const double moved = (a[0] - start[0]).norm().item<double>();
  const double apart = (a[0] - b[0]).norm().item<double>();
  EXPECT_GT(moved, 1.0);
  EXPECT_LT(apart, 0.05 * moved) << "moved " << moved << ", apart " << apart;
  EXPECT_GT(apart, 0.0) << "the quantization should be visible";
}

// On the CPU a float32 parameter takes the plugin's one-pass loop; FUSEBOX_ADAMW8BIT_ATEN=1 sends
// it through the ATen operations that every other device and dtype takes. The two compute the
// same formulas, but ATen's vectorised kernels fuse some multiply-adds (not in a tensor's scalar
// tail), so they agree to float rounding, not bit for bit; a moment that lands within rounding of
// a boundary between two codes may take either. One step from the same state (after 5 steps,
// blocks of 100 with a padded last one, weight decay): parameters within 1e-6 (a ten-thousandth
// of lr), nearly every code the same, the block scales to float rounding.
TEST(AdamW8bit, TheCpuLoopAgreesWithTheAtenPath) {
  const fbt::Args args = {{"lr", "0.01"}, {"weight_decay", "0.1"}, {"block_size", "100"}};
  std::shared_ptr<fusebox::Optimizer> trained;
  const auto params = train("adamw8bit.so", args, 5, &trained);
  const fusebox::StateDict state = trained->state_dict();
  const std::vector<at::Tensor> grads = {at::randn({96, 48}), at::randn({48})};
  auto one_step = [&](bool aten) {
    if (aten) {
      EXPECT_EQ(setenv("FUSEBOX_ADAMW8BIT_ATEN", "1", 1), 0);
    }
    std::vector<at::Tensor> p = fbt::leaf_copies(params);
    auto opt = fbt::make("adamw8bit.so", p, args);
    fusebox::StateDict copy;
    for (const auto& [key, t] : state) copy[key] = t.clone();
    opt->load_state_dict(copy);
    fbt::set_grads(p, grads);
    opt->step();
    unsetenv("FUSEBOX_ADAMW8BIT_ATEN");
    return std::make_pair(p, opt->state_dict());
  };
  const auto [pa, sa] = one_step(false);
  const auto [pb, sb] = one_step(true);
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_LT((pa[i] - pb[i]).abs().max().item<double>(), 1e-6) << i;
    EXPECT_FALSE(at::equal(pa[i], params[i])) << i;
  }
  EXPECT_EQ(sa.at("g0.p0/exp_avg_codes").sizes(), (std::vector<int64_t>{47, 100}));
  ASSERT_EQ(sa.size(), sb.size());
  for (const auto& [key, t] : sa) {
    ASSERT_TRUE(sb.count(key)) << key;
    ASSERT_EQ(t.scalar_type(), sb.at(key).scalar_type()) << key;
    if (t.scalar_type() == at::kByte)
      EXPECT_GT(t.eq(sb.at(key)).to(at::kDouble).mean().item<double>(), 0.999) << key;
    else
      EXPECT_TRUE(at::allclose(t, sb.at(key), 1e-5, 1e-12)) << key;
  }
}

// One block holds gradients from 1e-12 to 1e3: the tiny ones' second moments are far below the
// smallest code times the block's scale. They are kept at that smallest code, not rounded to 0,
// so with a constant gradient (AdamW: steps of exactly lr) each step stays within twice lr (the
// rounding of v), never lr·m/eps.
TEST(AdamW8bit, ATinySecondMomentNeverDividesByEpsAlone) {
  const fbt::Args args = {{"lr", "0.01"}, {"weight_decay", "0"}, {"min_8bit_size", "0"}};
  at::Tensor g = at::pow(10.0, at::linspace(-12, 3, 256, at::kDouble)).to(at::kFloat);
  std::vector<at::Tensor> params = fbt::leaf_copies({at::zeros({256})});
  auto opt = fbt::make("adamw8bit.so", params, args);
  for (int s = 0; s < 3; ++s) {
    const at::Tensor before = params[0].detach().clone();
    fbt::set_grads(params, {g});
    opt->step();
    const double largest = (params[0] - before).abs().max().item<double>();
    EXPECT_LE(largest, 0.02) << "step " << s + 1;
  }
}

// A checkpoint written with another block size (or with float32 moments) is read in its own
// layout and goes on in the new one, close to where it would have been.
TEST(AdamW8bit, StateFromAnotherBlockSizeGoesOn) {
  const fbt::Args args = {{"lr", "0.01"}};
  std::shared_ptr<fusebox::Optimizer> first;
  std::vector<at::Tensor> params =
      train("adamw8bit.so", {{"lr", "0.01"}, {"block_size", "64"}}, 10, &first);
  for (const char* size : {"256", "16"}) {
    fbt::Args other = args;
    other["block_size"] = size;
    auto opt = fbt::make("adamw8bit.so", params, other);
    opt->load_state_dict(first->state_dict());
    fbt::set_grads(params, {at::ones({96, 48}), at::ones({48})});
    ASSERT_NO_THROW(opt->step());
    const int64_t blocks = (96 * 48 + std::stoll(size) - 1) / std::stoll(size);
    EXPECT_EQ(opt->state_dict().at("g0.p0/exp_avg_codes").size(0), blocks) << size;
    EXPECT_TRUE(params[0].isfinite().all().item<bool>());
  }
  // Codes that do not fit the parameter are refused, naming the entry.
  fusebox::StateDict bad = first->state_dict();
  bad["g0.p0/exp_avg_codes"] = at::zeros({2, 16}, at::kByte);
  auto opt = fbt::make("adamw8bit.so", params, args);
  opt->load_state_dict(bad);
  fbt::set_grads(params, {at::ones({96, 48}), at::ones({48})});
  try {
    opt->step();
    ADD_FAILURE() << "mismatched codes were accepted";
  } catch (const fusebox::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'exp_avg_codes' does not fit this parameter"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
