// Time per optimizer step of each per-parameter plugin against the same update written with plain
// out-of-place tensor expressions, for a few parameter sizes. Prints a markdown table.
//
//   plugin_step_bench [--min-seconds S]
//
// Plugins are found like the trainer finds them (--plugin-dir is not needed in a build tree).
// Each row also checks that both versions compute the same step (allclose), so the comparison is
// between equal work.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fusebox/core/plugin_registry.h"

namespace {

using Clock = std::chrono::steady_clock;
using Args = std::map<std::string, std::string>;

// An out-of-place update: new parameter from parameter, gradient and state (reassigned).
using NaiveStep = std::function<at::Tensor(const at::Tensor& p, const at::Tensor& g,
                                           std::map<std::string, at::Tensor>& st, int64_t t)>;

at::Tensor rms(const at::Tensor& x) { return x.norm() / std::sqrt(double(x.numel())); }

at::Tensor factored_rsqrt(const at::Tensor& r, const at::Tensor& c) {
  return at::rsqrt(r / r.mean(-1, true)).unsqueeze(-1) * at::rsqrt(c).unsqueeze(-2);
}

struct Case {
  std::string file;
  Args args;
  NaiveStep naive;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  out.push_back({"sgd.so",
                 {{"lr", "0.01"}, {"momentum", "0.9"}, {"weight_decay", "0.01"}},
                 [](const at::Tensor& p, const at::Tensor& g0, auto& st, int64_t t) {
                   at::Tensor g = g0 + 0.01 * p;
                   st["buf"] = t == 1 ? g : 0.9 * st["buf"] + g;
                   return p - 0.01 * st["buf"];
                 }});
  out.push_back(
      {"adafactor_fused.so", {}, [](const at::Tensor& p, const at::Tensor& g, auto& st, int64_t t) {
         const double rho = std::min(1e-2, 1 / std::sqrt(double(t)));
         at::Tensor alpha = rho * at::clamp_min(rms(p), 1e-3);
         const double b = 1 - std::pow(double(t), -0.8);
         at::Tensor q = g * g + 1e-30;
         if (t == 1) st["r"] = at::zeros({p.size(0)}), st["c"] = at::zeros({p.size(1)});
         st["r"] = b * st["r"] + (1 - b) * q.mean(-1);
         st["c"] = b * st["c"] + (1 - b) * q.mean(-2);
         at::Tensor u = g * factored_rsqrt(st["r"], st["c"]);
         u = u / at::clamp_min(rms(u), 1.0);
         return p - alpha * u;
       }});
  auto adam = [](double wd_decoupled) {
    return [wd_decoupled](const at::Tensor& p0, const at::Tensor& g, auto& st, int64_t t) {
      const double lr = 1e-3, b1 = 0.9, b2 = 0.999;
      at::Tensor p = p0 * (1 - lr * wd_decoupled);
      if (t == 1) st["m"] = at::zeros_like(p), st["v"] = at::zeros_like(p);
      st["m"] = b1 * st["m"] + (1 - b1) * g;
      st["v"] = b2 * st["v"] + (1 - b2) * g * g;
      const double bc1 = 1 - std::pow(b1, double(t)), bc2 = 1 - std::pow(b2, double(t));
      return p - (lr / bc1) * st["m"] / (at::sqrt(st["v"]) / std::sqrt(bc2) + 1e-8);
    };
  };
  out.push_back({"adam.so", {{"lr", "1e-3"}}, adam(0)});
  out.push_back({"adamw.so", {{"lr", "1e-3"}, {"weight_decay", "0.01"}}, adam(0.01)});
  out.push_back({"lion.so",
                 {{"lr", "1e-4"}, {"weight_decay", "0.1"}},
                 [](const at::Tensor& p0, const at::Tensor& g, auto& st, int64_t t) {
                   if (t == 1) st["m"] = at::zeros_like(p0);
                   at::Tensor p = p0 * (1 - 1e-4 * 0.1);
                   p = p - 1e-4 * at::sign(0.9 * st["m"] + 0.1 * g);
                   st["m"] = 0.99 * st["m"] + 0.01 * g;
                   return p;
                 }});
  out.push_back({"came.so",
                 {{"lr", "1e-4"}},
                 [](const at::Tensor& p, const at::Tensor& g, auto& st, int64_t t) {
                   if (t == 1) {
                     st["m"] = at::zeros_like(p);
                     for (const char* k : {"r", "rr"}) st[k] = at::zeros({p.size(0)});
                     for (const char* k : {"c", "rc"}) st[k] = at::zeros({p.size(1)});
                   }
                   at::Tensor q = g * g + 1e-30;
                   st["r"] = 0.999 * st["r"] + 0.001 * q.mean(-1);
                   st["c"] = 0.999 * st["c"] + 0.001 * q.mean(-2);
                   at::Tensor u = g * factored_rsqrt(st["r"], st["c"]);
                   u = u / at::clamp_min(rms(u), 1.0);
                   st["m"] = 0.9 * st["m"] + 0.1 * u;
                   at::Tensor res = (u - st["m"]) * (u - st["m"]) + 1e-16;
                   st["rr"] = 0.9999 * st["rr"] + 0.0001 * res.mean(-1);
                   st["rc"] = 0.9999 * st["rc"] + 0.0001 * res.mean(-2);
                   return p - 1e-4 * factored_rsqrt(st["rr"], st["rc"]) * st["m"];
                 }});
  return out;
}

// Median seconds per call of `f`, over at least `min_seconds` and 5 calls, after 2 warm-up calls.
double time_per_call(const std::function<void()>& f, double min_seconds) {
  f(), f();
  std::vector<double> times;
  const auto start = Clock::now();
  while (times.size() < 5 ||
         std::chrono::duration<double>(Clock::now() - start).count() < min_seconds) {
    const auto t0 = Clock::now();
    f();
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

fusebox::UserArgs user_args(const Args& args) {
  fusebox::UserArgs out;
  for (const auto& [k, v] : args) out[k] = fusebox::UserArg{std::monostate{}, v, "bench"};
  return out;
}

// Time per plugin step for a (rows x cols) parameter of `dtype`.
double plugin_time(fusebox::LoadedPlugin& plugin, const Args& args, int64_t rows, int64_t cols,
                   at::ScalarType dtype, double min_seconds) {
  fusebox::ParamGroup group;
  group.params = {at::randn({rows, cols}).to(dtype).requires_grad_(true)};
  group.params[0].mutable_grad() = at::randn({rows, cols}).to(dtype);
  auto opt = plugin.create({group}, plugin.validate(user_args(args)));
  return time_per_call([&] { opt->step(); }, min_seconds);
}

}  // namespace

int main(int argc, char** argv) {
  double min_seconds = 0.3;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--min-seconds") == 0 && i + 1 < argc) {
      min_seconds = std::atof(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--min-seconds S]\n", argv[0]);
      return 2;
    }
  }
  at::manual_seed(0);
  fusebox::PluginRegistry registry;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{64, 64}, {512, 512}, {2048, 2048}};
  std::printf("Per-step time on %d thread(s); ratio = plugin / out-of-place (lower is better).\n\n",
              at::get_num_threads());
  std::printf(
      "| plugin | shape | plugin fp32 (ms) | out-of-place fp32 (ms) | ratio | "
      "plugin bf16 (ms) | same step |\n");
  std::printf("|---|---|---:|---:|---:|---:|:---:|\n");
  for (const Case& c : cases()) {
    auto plugin = registry.load_file(c.file);
    for (const auto& [rows, cols] : shapes) {
      // Correctness check: one step from the same values and gradient.
      at::Tensor init = at::randn({rows, cols}), grad = at::randn({rows, cols});
      fusebox::ParamGroup group;
      group.params = {init.clone().requires_grad_(true)};
      group.params[0].mutable_grad() = grad;
      auto opt = plugin->create({group}, plugin->validate(user_args(c.args)));
      opt->step();
      std::map<std::string, at::Tensor> st;
      const bool same =
          at::allclose(group.params[0].detach(), c.naive(init, grad, st, 1), 1e-4, 1e-6);

      const double t_plugin = plugin_time(*plugin, c.args, rows, cols, at::kFloat, min_seconds);
      const double t_bf16 = plugin_time(*plugin, c.args, rows, cols, at::kBFloat16, min_seconds);
      at::Tensor p = at::randn({rows, cols}), g = at::randn({rows, cols});
      std::map<std::string, at::Tensor> state;
      int64_t t = 0;
      const double t_naive = time_per_call([&] { p = c.naive(p, g, state, ++t); }, min_seconds);
      std::printf("| %s | %lldx%lld | %.3f | %.3f | %.2f | %.3f | %s |\n",
                  plugin->info().name.c_str(), static_cast<long long>(rows),
                  static_cast<long long>(cols), 1e3 * t_plugin, 1e3 * t_naive, t_plugin / t_naive,
                  1e3 * t_bf16, same ? "yes" : "NO");
      std::fflush(stdout);
    }
  }
  return 0;
}
