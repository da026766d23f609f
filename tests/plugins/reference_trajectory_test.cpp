// Plugins against trajectories of their reference implementations (tests/data/*.txt), run in
// float64 and float32. Every "== header" of a file must be mapped to a plugin and its arguments.
#include <cmath>

#include "plugin_test_support.h"

namespace {

struct Case {
  std::string file;
  fbt::Args args;
};
using Table = std::map<std::string, Case>;

const Table& fixed_gradient_table() {
  static const Table t = {
      {"torch.optim.Adam lr=0.1 betas=(0.9,0.999) eps=1e-8 wd=0.1 (L2) dtype=float64",
       {"adam.so",
        {{"lr", "0.1"}, {"betas", "(0.9,0.999)"}, {"eps", "1e-8"}, {"weight_decay", "0.1"}}}},
      {"torch.optim.Adam lr=0.1 amsgrad=True wd=0 dtype=float64",
       {"adam.so", {{"lr", "0.1"}, {"amsgrad", "true"}, {"weight_decay", "0"}}}},
      {"torch.optim.AdamW lr=0.1 wd=0.1 dtype=float64",
       {"adamw.so", {{"lr", "0.1"}, {"weight_decay", "0.1"}}}},
      {"torch.optim.SGD lr=0.1 momentum=0.9 dampening=0.1 wd=0.01 dtype=float64",
       {"sgd.so",
        {{"lr", "0.1"}, {"momentum", "0.9"}, {"dampening", "0.1"}, {"weight_decay", "0.01"}}}},
      {"torch.optim.SGD lr=0.1 momentum=0.9 nesterov=True wd=0.01 dtype=float64",
       {"sgd.so",
        {{"lr", "0.1"}, {"momentum", "0.9"}, {"nesterov", "true"}, {"weight_decay", "0.01"}}}},
      {"lion-pytorch Lion lr=0.01 betas=(0.9,0.99) wd=0.1 dtype=float64",
       {"lion.so", {{"lr", "0.01"}, {"betas", "(0.9,0.99)"}, {"weight_decay", "0.1"}}}},
      {"HF Adafactor lr=0.01 relative_step=False scale_parameter=False beta1=None wd=0 "
       "dtype=float64",
       {"adafactor_fused.so",
        {{"lr", "0.01"},
         {"relative_step", "false"},
         {"scale_parameter", "false"},
         {"beta1", "none"},
         {"weight_decay", "0"}}}},
      {"HF Adafactor defaults (lr=None relative_step=True scale_parameter=True "
       "warmup_init=False) dtype=float64",
       {"adafactor_fused.so", {}}},
      {"HF Adafactor relative_step=True warmup_init=True scale_parameter=True dtype=float64",
       {"adafactor_fused.so",
        {{"relative_step", "true"}, {"warmup_init", "true"}, {"scale_parameter", "true"}}}},
      {"HF Adafactor lr=0.01 relative_step=False scale_parameter=True beta1=0.9 wd=0.1 "
       "clip_threshold=1.0 dtype=float64",
       {"adafactor_fused.so",
        {{"lr", "0.01"},
         {"relative_step", "false"},
         {"scale_parameter", "true"},
         {"beta1", "0.9"},
         {"weight_decay", "0.1"},
         {"clip_threshold", "1.0"}}}},
      {"HF Adafactor lr=0.01 relative_step=False scale_parameter=False clip_threshold=0.5 "
       "dtype=float64",
       {"adafactor_fused.so",
        {{"lr", "0.01"},
         {"relative_step", "false"},
         {"scale_parameter", "false"},
         {"clip_threshold", "0.5"}}}},
      {"dadaptation DAdaptAdam defaults (lr=1, d0=1e-6, decouple=False, bias_corr=False) "
       "dtype=float64",
       {"dadaptation.so",
        {{"lr", "1"}, {"d0", "1e-6"}, {"decouple", "false"}, {"use_bias_correction", "false"}}}},
      {"dadaptation DAdaptAdam decouple=True wd=0.1 use_bias_correction=True dtype=float64",
       {"dadaptation.so",
        {{"decouple", "true"}, {"weight_decay", "0.1"}, {"use_bias_correction", "true"}}}},
      {"prodigyopt Prodigy defaults (lr=1, d0=1e-6, d_coef=1, beta3=sqrt(beta2), decouple=True, "
       "wd=0) dtype=float64",
       {"prodigy.so",
        {{"lr", "1"},
         {"d0", "1e-6"},
         {"d_coef", "1"},
         {"beta3", "none"},
         {"decouple", "true"},
         {"weight_decay", "0"}}}},
      {"prodigyopt Prodigy wd=0.01 safeguard_warmup=True use_bias_correction=True dtype=float64",
       {"prodigy.so",
        {{"weight_decay", "0.01"}, {"safeguard_warmup", "true"}, {"use_bias_correction", "true"}}}},
      {"prodigyopt Prodigy d0=1e-2 d_coef=2 growth_rate=1.5 dtype=float64",
       {"prodigy.so", {{"d0", "1e-2"}, {"d_coef", "2"}, {"growth_rate", "1.5"}}}},
      {"prodigyopt Prodigy slice_p=2 dtype=float64", {"prodigy.so", {{"slice_p", "2"}}}},
      {"prodigyopt Prodigy betas=(0.0,0.999) (no exp_avg) dtype=float64",
       {"prodigy.so", {{"betas", "(0.0,0.999)"}}}},
      {"came-pytorch CAME lr=0.01 betas=(0.9,0.999,0.9999) eps=(1e-30,1e-16) wd=0 dtype=float64",
       {"came.so",
        {{"lr", "0.01"},
         {"betas", "(0.9,0.999)"},
         {"beta3", "0.9999"},
         {"eps", "(1e-30,1e-16)"},
         {"weight_decay", "0"}}}},
      {"came-pytorch CAME lr=0.01 wd=0.1 dtype=float64",
       {"came.so", {{"lr", "0.01"}, {"weight_decay", "0.1"}}}},
  };
  return t;
}

const Table& auto_lr_table() {
  static const Table t = {
      {"DAdaptAdam defaults", {"dadaptation.so", {}}},
      {"Prodigy defaults", {"prodigy.so", {}}},
  };
  return t;
}

// Gradient source for a block: given the step number (1-based) and the current parameters.
using GradFn = std::function<std::vector<at::Tensor>(int, const std::vector<at::Tensor>&)>;

// Runs every block of `file` through its plugin in `dtype`; checks W, b and every other listed
// value (d, d_hat, d_max) against the optimizer's saved global state.
// W0 and b0 are those of the fixed-gradient file (the auto-LR file refers to them).
//
// Tolerances: `rel` (1e-9 in float64, 1e-5 in float32) for every value, except where rounding the
// parameters to the dtype provably costs more. The auto-LR estimates (d, d_hat, d_max) use
// Prodigy's <g, θ0 - θ>, a difference of nearly equal numbers: rounding θ to the dtype (unit
// roundoff u) perturbs it by about u·||θ0|| against a displacement ||θ1 - θ0|| after step 1 (a few
// 1e-6 here), so an estimate is only good to ε = max(rel, u·||θ0|| / ||θ1 - θ0||) (about 1e-2 in
// float32, 1e-11 in float64). An estimate off by ε scales the steps by at most 1 + ε, so θk is then
// good to rel + ε·||θk - θ0|| / ||θk||.
void run_file(const fbt::RefFile& file, const Table& table, const GradFn& grads,
              at::ScalarType dtype, double rel) {
  const double unit_roundoff = dtype == at::kFloat ? std::ldexp(1.0, -24) : std::ldexp(1.0, -53);
  const fbt::RefFile fixed = fbt::read_reference("fixed_gradient_3_steps.txt");
  const fbt::NumberList w0 = fbt::find_list(fixed.comments, "W0");
  const fbt::NumberList b0 = fbt::find_list(fixed.comments, "b0");
  ASSERT_FALSE(file.blocks.empty());
  std::set<std::string> used;
  for (const fbt::RefBlock& block : file.blocks) {
    SCOPED_TRACE(block.header + (dtype == at::kFloat ? " [float32]" : " [float64]"));
    auto it = table.find(block.header);
    if (it == table.end()) {
      ADD_FAILURE() << "reference header not mapped to a plugin: " << block.header;
      continue;
    }
    used.insert(block.header);
    std::vector<at::Tensor> params = {w0.tensor(dtype).to(fbt::device()).requires_grad_(),
                                      b0.tensor(dtype).to(fbt::device()).requires_grad_()};
    auto opt = fbt::make(it->second.file, params, it->second.args);
    ASSERT_FALSE(block.steps.empty());
    ASSERT_EQ(block.steps[0].step, 1);
    const at::Tensor theta0 = at::cat({w0.tensor().reshape(-1), b0.tensor()});
    auto theta_ref = [](const fbt::RefStep& r) {
      return at::cat({r.values.at("W").tensor().reshape(-1), r.values.at("b").tensor()});
    };
    const bool has_estimates = block.steps[0].values.size() > 2;
    const double est_rel =
        std::max(rel, unit_roundoff * theta0.norm().item<double>() /
                          (theta_ref(block.steps[0]) - theta0).norm().item<double>());
    int done = 0;
    for (const fbt::RefStep& ref : block.steps) {
      for (; done < ref.step; ++done) {
        fbt::set_grads(params, grads(done + 1, params));
        opt->step();
      }
      SCOPED_TRACE("after step " + std::to_string(ref.step));
      ASSERT_EQ(ref.values.count("W"), 1u);
      ASSERT_EQ(ref.values.count("b"), 1u);
      const at::Tensor theta_k = theta_ref(ref);
      const double param_rel = has_estimates
                                   ? rel + est_rel * (theta_k - theta0).norm().item<double>() /
                                               theta_k.norm().item<double>()
                                   : rel;
      EXPECT_TRUE(fbt::close(params[0], ref.values.at("W"), param_rel)) << "W";
      EXPECT_TRUE(fbt::close(params[1], ref.values.at("b"), param_rel)) << "b";
      const fusebox::StateDict state = opt->state_dict();
      for (const auto& [key, expected] : ref.values) {
        if (key == "W" || key == "b") continue;
        auto s = state.find("@optimizer/" + key);
        ASSERT_NE(s, state.end()) << "optimizer does not save " << key;
        EXPECT_TRUE(fbt::close(s->second, expected, est_rel)) << key;
      }
    }
  }
  for (const auto& [header, c] : table)
    EXPECT_TRUE(used.count(header)) << "table entry matches no header in the file: " << header;
}

class ReferenceTrajectory : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  double tolerance() const { return GetParam() == at::kDouble ? 1e-9 : 1e-5; }
};

TEST_P(ReferenceTrajectory, FixedGradients) {
  const fbt::RefFile file = fbt::read_reference("fixed_gradient_3_steps.txt");
  // "#   step k: gW = [...]   gb = [...]" lines of the header comment, by step.
  std::map<int, std::vector<fbt::NumberList>> by_step;
  std::istringstream lines(file.comments);
  for (std::string line; std::getline(lines, line);) {
    size_t at = line.find("step ");
    if (at == std::string::npos || line.find("gW") == std::string::npos) continue;
    by_step[std::stoi(line.substr(at + 5))] = {fbt::find_list(line, "gW"),
                                               fbt::find_list(line, "gb")};
  }
  ASSERT_EQ(by_step.size(), 3u);
  GradFn grads = [&](int step, const std::vector<at::Tensor>&) {
    const auto& g = by_step.at(step);
    return std::vector<at::Tensor>{g[0].tensor(), g[1].tensor()};
  };
  run_file(file, fixed_gradient_table(), grads, GetParam(), tolerance());
}

TEST_P(ReferenceTrajectory, AutoLrOnQuadratic) {
  const fbt::RefFile file = fbt::read_reference("auto_lr_10_steps.txt");
  const at::Tensor tw = fbt::find_list(file.comments, "TW").tensor();
  const at::Tensor tb = fbt::find_list(file.comments, "TB").tensor();
  GradFn grads = [&](int, const std::vector<at::Tensor>& p) {
    return std::vector<at::Tensor>{p[0].detach() - tw.to(p[0].options()),
                                   p[1].detach() - tb.to(p[1].options())};
  };
  run_file(file, auto_lr_table(), grads, GetParam(), tolerance());
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ReferenceTrajectory, ::testing::Values(at::kDouble, at::kFloat),
                         [](const ::testing::TestParamInfo<at::ScalarType>& i) {
                           return std::string(i.param == at::kDouble ? "float64" : "float32");
                         });

TEST(ReferenceParser, ReadsNestedListsWithShape) {
  std::string text = "x W0 = [[0.5, -1, 0.25], [1.5, -0.75, 2]]  b0=[1e-3, 2]";
  fbt::NumberList w = fbt::find_list(text, "W0");
  EXPECT_EQ(w.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(w.values, (std::vector<double>{0.5, -1, 0.25, 1.5, -0.75, 2}));
  fbt::NumberList b = fbt::find_list(text, "b0");
  EXPECT_EQ(b.shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(b.values, (std::vector<double>{1e-3, 2}));
  EXPECT_THROW(fbt::find_list(text, "W1"), std::runtime_error);
}

}  // namespace
