// The CUDA kernels' per-element math (plugins/cuda/update_kernels_math.h), run on the CPU over
// random data, against what the Adam/AdamW and Adafactor plugins' ATen path computes: fp32 to 1e-6
// relative. The host drivers below follow the kernels stage by stage (update_kernels.cu), so a
// change to either side that alters the result shows here without a GPU; with
// FUSEBOX_TEST_DEVICE=cuda on a CUDA build the plugins take the kernel path and the same
// comparison checks the kernels themselves.
#include <c10/util/BFloat16.h>

#include <cmath>
#include <random>

#include "plugin_test_support.h"
#include "update_kernels_math.h"

namespace {

namespace fk = fusebox_plugins::cuda;

std::vector<float> values(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous().reshape(-1);
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

/// Every element of `got` within `rel` of `want`, relative to the larger of |want| and, when
/// given, `scale` (the element's largest magnitude over its earlier steps): a result near zero that
/// is the difference of two larger terms is as exact as those terms, not relative to itself, and a
/// moving average carries that error on.
::testing::AssertionResult close(const std::vector<float>& got, const at::Tensor& want_t,
                                 double rel, const std::vector<float>* history = nullptr) {
  const std::vector<float> want = values(want_t);
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    const double scale = std::max(std::abs(w), history ? double{(*history)[i]} : 0.0);
    if (!(std::abs(g - w) <= rel * scale))
      return ::testing::AssertionFailure()
             << "element " << i << ": host math " << g << " vs plugin " << w << " (error "
             << std::abs(g - w) << " > " << rel << " x " << scale << ")";
  }
  return ::testing::AssertionSuccess();
}

/// Raises each entry of `history` to |x| of the matching element.
void track(std::vector<float>& history, const std::vector<float>& x) {
  history.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) history[i] = std::max(history[i], std::abs(x[i]));
}

const at::Tensor& state_of(const fusebox::StateDict& state, const std::string& key) {
  auto it = state.find("g0.p0/" + key);
  if (it == state.end()) throw std::runtime_error("no state " + key);
  return it->second;
}

double arg(const fbt::Args& args, const std::string& key, double fallback) {
  auto it = args.find(key);
  return it == args.end() || it->second == "none" ? fallback : std::stod(it->second);
}

// ---- Adam / AdamW --------------------------------------------------------------------------

struct AdamCase {
  std::string file;
  fbt::Args args;
};

TEST(CudaMath, AdamElementMatchesThePluginsAtenPath) {
  const std::vector<AdamCase> cases = {
      {"adamw.so", {{"lr", "0.01"}}},
      {"adamw.so", {{"lr", "0.05"}, {"weight_decay", "0.1"}, {"amsgrad", "true"}}},
      {"adamw.so", {{"lr", "0.01"}, {"weight_decay", "0"}, {"betas", "(0.8,0.99)"}}},
      {"adam.so", {{"lr", "0.01"}, {"weight_decay", "0.1"}, {"amsgrad", "true"}}},
      {"adam.so", {{"lr", "0.1"}, {"eps", "1e-6"}}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(fbt::label(c.file, c.args));
    const bool decoupled = c.file == "adamw.so";
    const bool amsgrad = c.args.count("amsgrad") && c.args.at("amsgrad") == "true";
    const double lr = arg(c.args, "lr", 1e-3), eps = arg(c.args, "eps", 1e-8);
    const double wd = arg(c.args, "weight_decay", decoupled ? 1e-2 : 0.0);
    double b1 = 0.9, b2 = 0.999;
    if (c.args.count("betas")) b1 = 0.8, b2 = 0.99;

    at::manual_seed(21);
    auto params = fbt::leaf_copies({at::randn({33, 65})});
    auto opt = fbt::make(c.file, params, c.args);
    std::vector<float> p = values(params[0]), m(p.size()), v(p.size()), vmax(p.size());
    std::vector<float> p_seen, m_seen, v_seen;
    for (int64_t t = 1; t <= 5; ++t) {
      const at::Tensor g = at::randn({33, 65}) * (t == 3 ? 1e-3 : 1.0);
      fbt::set_grads(params, {g});
      opt->step();
      const fk::AdamScalars s = fk::make_adam_scalars(lr, b1, b2, eps, wd, decoupled, amsgrad, t);
      const std::vector<float> gv = values(g);
      // The moments take (1-b1)·g' and (1-b2)·g'² of g' = g + l2·θ (Adam's L2), a sum of terms
      // of either sign: their errors scale with |g| + l2·|θ|, not with |g'|.
      std::vector<float> m_terms(p.size()), v_terms(p.size());
      for (size_t i = 0; i < p.size(); ++i) {
        const float size = std::abs(gv[i]) + s.l2 * std::abs(p[i]);
        m_terms[i] = (1 - b1) * size;
        v_terms[i] = (1 - b2) * size * size;
      }
      track(p_seen, p);
      track(m_seen, m);
      track(m_seen, m_terms);
      track(v_seen, v);
      track(v_seen, v_terms);
      for (size_t i = 0; i < p.size(); ++i) fk::adam_element(p[i], gv[i], m[i], v[i], vmax[i], s);
      SCOPED_TRACE("step " + std::to_string(t));
      const fusebox::StateDict state = opt->state_dict();
      ASSERT_TRUE(close(p, params[0], 1e-6, &p_seen)) << "parameter";
      ASSERT_TRUE(close(m, state_of(state, "exp_avg"), 1e-6, &m_seen)) << "exp_avg";
      ASSERT_TRUE(close(v, state_of(state, "exp_avg_sq"), 1e-6, &v_seen)) << "exp_avg_sq";
      if (amsgrad) {
        ASSERT_TRUE(close(vmax, state_of(state, "max_exp_avg_sq"), 1e-6, &v_seen))
            << "max_exp_avg_sq";
      }
    }
  }
}

// bf16 parameters: the kernel loads them exactly, computes in fp32 and rounds to nearest once,
// as the ATen path's fp32 copy and copy-back do; only an fp32 result one ulp away from the ATen
// one that straddles a bf16 rounding boundary could differ, by one bf16 ulp.
TEST(CudaMath, AdamBf16RoundsTheFp32ResultToNearest) {
  at::manual_seed(22);
  auto params = fbt::leaf_copies({at::randn({17, 40}).to(at::kBFloat16)});
  auto opt = fbt::make("adamw.so", params, {{"lr", "0.01"}});
  std::vector<float> p = values(params[0]), m(p.size()), v(p.size()), vmax(p.size());
  for (int64_t t = 1; t <= 3; ++t) {
    const at::Tensor g = at::randn({17, 40}).to(at::kBFloat16);
    fbt::set_grads(params, {g});
    opt->step();
    const fk::AdamScalars s = fk::make_adam_scalars(0.01, 0.9, 0.999, 1e-8, 1e-2, true, false, t);
    const std::vector<float> gv = values(g);
    size_t exact = 0;
    const std::vector<float> want = values(params[0]);
    for (size_t i = 0; i < p.size(); ++i) {
      fk::adam_element(p[i], gv[i], m[i], v[i], vmax[i], s);
      p[i] = static_cast<float>(c10::BFloat16(p[i]));  // round to nearest even
      exact += p[i] == want[i];
    }
    EXPECT_TRUE(close(p, params[0], std::ldexp(1.0, -8))) << "step " << t;
    EXPECT_GE(exact, p.size() * 99 / 100) << "step " << t;
  }
}

// ---- Adafactor -------------------------------------------------------------------------------

/// The kernels' stages for one factored step of a [B, R, C] parameter, on the host. Sums are
/// accumulated in double (the kernels use fp32 tree sums; both are within rounding of ATen's).
struct FactoredHost {
  int64_t B, R, C;
  std::vector<float> p, row, col, m;

  FactoredHost(const at::Tensor& param, int64_t b, int64_t r, int64_t c)
      : B(b), R(r), C(c), p(values(param)), row(B * R), col(B * C), m(p.size()) {}

  void step(const std::vector<float>& g, const fk::AdafactorScalars& s, double eps2, bool scale) {
    const int64_t n = B * R * C;
    double p_sq = 0;
    for (float x : p) p_sq += static_cast<double>(x) * x;
    const float rms = static_cast<float>(std::sqrt(p_sq)) / s.sqrt_n;  // p.norm() / sqrt(n)
    const float alpha = std::max(rms, static_cast<float>(eps2)) * s.rho;
    // 1. row and column statistics
    for (int64_t br = 0; br < B * R; ++br) {
      double sum = 0;
      for (int64_t c = 0; c < C; ++c) sum += fk::adafactor_square(g[br * C + c], s.eps1);
      row[br] = fk::adafactor_ema(row[br], static_cast<float>(sum) / static_cast<float>(C), s);
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = 0; c < C; ++c) {
        double sum = 0;
        for (int64_t r = 0; r < R; ++r) sum += fk::adafactor_square(g[(b * R + r) * C + c], s.eps1);
        col[b * C + c] =
            fk::adafactor_ema(col[b * C + c], static_cast<float>(sum) / static_cast<float>(R), s);
      }
    // 2. factors
    std::vector<float> rfac(B * R), cfac(B * C);
    for (int64_t b = 0; b < B; ++b) {
      double sum = 0;
      for (int64_t r = 0; r < R; ++r) sum += row[b * R + r];
      const float mean = static_cast<float>(sum) / static_cast<float>(R);
      for (int64_t r = 0; r < R; ++r)
        rfac[b * R + r] = fk::adafactor_row_factor(row[b * R + r], mean);
      for (int64_t c = 0; c < C; ++c) cfac[b * C + c] = fk::adafactor_col_factor(col[b * C + c]);
    }
    // 3. Σu², with the kernels' index arithmetic
    const fk::FastDivider by_c = fk::make_fast_divider(static_cast<uint32_t>(C));
    const fk::FastDivider by_r = fk::make_fast_divider(static_cast<uint32_t>(R));
    std::vector<float> u(n);
    double u_sq = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t br = fk::fast_div(static_cast<uint32_t>(i), by_c);
      const uint32_t b = fk::fast_div(br, by_r);
      const int64_t bc = static_cast<int64_t>(b) * C + (i - static_cast<int64_t>(br) * C);
      u[i] = fk::adafactor_raw_update(g[i], rfac[br], cfac[bc]);
      u_sq += static_cast<double>(u[i]) * u[i];
    }
    // 4. clip, step size, moments, decay, update
    const float divisor = fk::adafactor_clip_divisor(static_cast<float>(u_sq), s);
    for (int64_t i = 0; i < n; ++i) {
      if (scale)
        fk::adafactor_apply(p[i], m[i], u[i], divisor, alpha, s);
      else
        fk::adafactor_apply_unscaled(p[i], m[i], u[i], divisor, s);
    }
  }
};

TEST(CudaMath, AdafactorFactoredStagesMatchThePluginsAtenPath) {
  const std::vector<fbt::Args> configs = {
      {},
      {{"lr", "0.01"}, {"relative_step", "false"}, {"beta1", "0.9"}, {"weight_decay", "0.1"}},
      {{"lr", "0.01"},
       {"relative_step", "false"},
       {"scale_parameter", "false"},
       {"clip_threshold", "0.5"},
       {"beta1", "0.8"},
       {"weight_decay", "0.1"}},
      {{"warmup_init", "true"}, {"clip_threshold", "100"}},
  };
  const std::vector<std::vector<int64_t>> shapes = {{24, 40}, {3, 5, 7}, {4, 2, 3, 3}, {1, 129}};
  for (const auto& args : configs)
    for (const auto& shape : shapes) {
      SCOPED_TRACE(fbt::label("adafactor_fused.so", args) + " shape " +
                   c10::str(at::IntArrayRef(shape)));
      const bool relative = !args.count("relative_step");
      const bool scale = !args.count("scale_parameter");
      const bool warmup = args.count("warmup_init") > 0;
      const double lr = arg(args, "lr", 0), clip = arg(args, "clip_threshold", 1.0);
      const double beta1 = arg(args, "beta1", -1), wd = arg(args, "weight_decay", 0);

      at::manual_seed(31);
      auto params = fbt::leaf_copies({at::randn(shape)});
      auto opt = fbt::make("adafactor_fused.so", params, args);
      const int64_t C = shape.back(), R = shape[shape.size() - 2];
      FactoredHost host(params[0], params[0].numel() / (R * C), R, C);
      std::vector<float> p_seen, m_seen;
      for (int64_t t = 1; t <= 4; ++t) {
        const at::Tensor g = at::randn(shape) * (t == 2 ? 1e-2 : 1.0);
        fbt::set_grads(params, {g});
        opt->step();
        const double td = static_cast<double>(t);
        const double rho = relative ? std::min(warmup ? 1e-6 * td : 1e-2, 1.0 / std::sqrt(td)) : lr;
        const double beta2 = 1.0 - std::pow(td, -0.8);
        const fk::AdafactorScalars s =
            fk::make_adafactor_scalars(1e-30, beta2, params[0].numel(), clip, rho, beta1, wd);
        track(p_seen, host.p);
        track(m_seen, host.m);
        host.step(values(g), s, 1e-3, scale);
        SCOPED_TRACE("step " + std::to_string(t));
        const fusebox::StateDict state = opt->state_dict();
        ASSERT_TRUE(close(host.p, params[0], 1e-6, &p_seen)) << "parameter";
        ASSERT_TRUE(close(host.row, state_of(state, "exp_avg_sq_row"), 1e-6)) << "row";
        ASSERT_TRUE(close(host.col, state_of(state, "exp_avg_sq_col"), 1e-6)) << "col";
        if (beta1 >= 0) {
          ASSERT_TRUE(close(host.m, state_of(state, "exp_avg"), 1e-6, &m_seen)) << "exp_avg";
        }
      }
    }
}

TEST(CudaMath, FastDividerEqualsIntegerDivision) {
  std::mt19937 rng(5);
  std::vector<uint32_t> divisors = {
      1, 2, 3, 5, 7, 9, 31, 32, 33, 1000, 4095, 4096, 65537, (1u << 31) - 1, 1u << 30};
  for (int i = 0; i < 50; ++i) divisors.push_back(1 + rng() % ((1u << 31) - 1));
  for (uint32_t d : divisors) {
    const fk::FastDivider f = fk::make_fast_divider(d);
    std::vector<uint32_t> ns = {0, 1, d - 1, d, d + 1, (1u << 31) - 1, (1u << 31) - 1 - d};
    for (int i = 0; i < 2000; ++i) ns.push_back(rng() % (1u << 31));
    for (uint32_t n : ns) {
      if (n >= (1u << 31)) continue;
      ASSERT_EQ(fk::fast_div(n, f), n / d) << n << " / " << d;
    }
  }
}

}  // namespace
