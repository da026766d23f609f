// Shared pieces of the optimizer plugin tests: loading plugins, building optimizers from text
// arguments, and reading the reference trajectory files in tests/data.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cctype>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../test_device.h"
#include "fusebox/core/plugin_registry.h"

namespace fbt {

using Args = std::map<std::string, std::string>;

/// One registry over the built plugin folder, shared by all tests.
inline fusebox::PluginRegistry& registry() {
  static fusebox::PluginRegistry reg([] {
    fusebox::LoaderOptions o;
    o.plugin_dirs = {FUSEBOX_PLUGIN_DIR};
    o.use_environment = false;
    o.use_default_dir = false;
    return o;
  }());
  return reg;
}

/// The plugin in file `file` (e.g. "adam.so").
inline std::shared_ptr<fusebox::LoadedPlugin> plugin(const std::string& file) {
  return registry().load_file(file);
}

/// Command-line style arguments, as the trainer passes them.
inline fusebox::UserArgs user_args(const Args& args) {
  fusebox::UserArgs out;
  for (const auto& [k, v] : args) out[k] = fusebox::UserArg{std::monostate{}, v, "test"};
  return out;
}

/// Validates `args` and builds an optimizer over one group of `params`.
inline std::shared_ptr<fusebox::Optimizer> make(const std::string& file,
                                                const std::vector<at::Tensor>& params,
                                                const Args& args = {}) {
  auto p = plugin(file);
  fusebox::ParamGroup g;
  g.params = params;
  return p->create({g}, p->validate(user_args(args)));
}

/// The device plugin tests run on (FUSEBOX_TEST_DEVICE, default cpu).
inline at::Device device() { return fusebox::testing::test_device(); }

/// Leaf tensors with requires_grad, deep copies of `src` on the test device.
inline std::vector<at::Tensor> leaf_copies(const std::vector<at::Tensor>& src) {
  std::vector<at::Tensor> out;
  for (const auto& t : src) out.push_back(t.detach().to(device()).clone().requires_grad_(true));
  return out;
}

/// Sets each parameter's gradient to a copy of `grads[i]` in the parameter's dtype and device.
inline void set_grads(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i].mutable_grad() = grads[i].to(params[i].options()).clone();
}

/// Every per-parameter plugin file with the arguments that exercise most of its code.
inline std::vector<std::pair<std::string, Args>> per_param_configs() {
  return {{"sgd.so", {{"lr", "0.1"}, {"momentum", "0.9"}, {"weight_decay", "0.01"}}},
          {"sgd.so", {{"lr", "0.1"}, {"momentum", "0.9"}, {"nesterov", "true"}}},
          {"adafactor_fused.so", {}},
          {"adafactor_fused.so",
           {{"lr", "0.01"}, {"relative_step", "false"}, {"beta1", "0.9"}, {"weight_decay", "0.1"}}},
          {"adam.so", {{"lr", "0.01"}, {"weight_decay", "0.1"}, {"amsgrad", "true"}}},
          {"adamw.so", {{"lr", "0.01"}}},
          // Blocks of 16, and 8-bit moments from 16 elements on: the tests' 6x8 tensors take the
          // quantized path, their 8-element ones the float32 one.
          {"adamw8bit.so", {{"lr", "0.01"}, {"block_size", "16"}, {"min_8bit_size", "16"}}},
          {"lion.so", {{"lr", "0.001"}, {"weight_decay", "0.1"}}},
          {"came.so", {{"lr", "0.01"}, {"weight_decay", "0.1"}}}};
}

/// The auto-LR plugins with arguments that exercise most of their code.
inline std::vector<std::pair<std::string, Args>> auto_lr_configs() {
  return {{"dadaptation.so", {}},
          {"dadaptation.so",
           {{"decouple", "true"}, {"weight_decay", "0.1"}, {"use_bias_correction", "true"}}},
          {"prodigy.so", {{"d0", "1e-3"}, {"slice_p", "3"}}},
          {"prodigy.so", {{"betas", "(0,0.999)"}, {"weight_decay", "0.1"}, {"decouple", "false"}}}};
}

/// A readable label for a configuration.
inline std::string label(const std::string& file, const Args& args) {
  std::string s = file;
  for (const auto& [k, v] : args) s += " " + k + "=" + v;
  return s;
}

// ---- Reference files ----------------------------------------------------------------------

/// A nested bracketed list of numbers, flattened, with its shape ("[[1, 2], [3, 4]]": {2, 2}).
struct NumberList {
  std::vector<double> values;
  std::vector<int64_t> shape;
  /// As a tensor of `dtype`.
  at::Tensor tensor(at::ScalarType dtype = at::kDouble) const {
    return torch::tensor(values, torch::kDouble).reshape(shape).to(dtype);
  }
};

/// Parses a nested list starting at text[pos] == '[' into `values`; advances pos past it and
/// returns the list's shape.
inline std::vector<int64_t> parse_list_into(const std::string& text, size_t& pos,
                                            std::vector<double>& values) {
  if (text.at(pos) != '[') throw std::runtime_error("expected '[' in: " + text);
  ++pos;
  int64_t n = 0;
  std::vector<int64_t> inner;
  while (true) {
    char c = text.at(pos);
    if (c == ']') {
      ++pos;
      break;
    } else if (c == ',' || c == ' ') {
      ++pos;
    } else if (c == '[') {
      inner = parse_list_into(text, pos, values);
      ++n;
    } else {
      size_t used = 0;
      values.push_back(std::stod(text.substr(pos), &used));
      pos += used;
      ++n;
    }
  }
  inner.insert(inner.begin(), n);
  return inner;
}

/// Parses a nested list starting at text[pos] == '['; advances pos past it.
inline NumberList parse_list(const std::string& text, size_t& pos) {
  NumberList out;
  out.shape = parse_list_into(text, pos, out.values);
  return out;
}

/// Finds "<key>" followed by optional spaces, '=', optional spaces and a list; parses the list.
inline NumberList find_list(const std::string& text, const std::string& key) {
  for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + 1)) {
    if (at > 0 && std::isalnum(static_cast<unsigned char>(text[at - 1]))) continue;
    size_t pos = at + key.size();
    while (pos < text.size() && text[pos] == ' ') ++pos;
    if (pos >= text.size() || text[pos] != '=') continue;
    ++pos;
    while (pos < text.size() && text[pos] == ' ') ++pos;
    if (pos < text.size() && text[pos] == '[') return parse_list(text, pos);
  }
  throw std::runtime_error("reference file: no list named " + key);
}

/// One "step N name=value ..." line: values by name (scalars are one-element lists).
struct RefStep {
  int step = 0;
  std::map<std::string, NumberList> values;
};

/// One "== header" block of a reference file.
struct RefBlock {
  std::string header;
  std::vector<RefStep> steps;
};

/// A reference file: its comment lines (joined) and its blocks.
struct RefFile {
  std::string comments;
  std::vector<RefBlock> blocks;
};

inline RefFile read_reference(const std::string& name) {
  const std::string path = std::string(FUSEBOX_TEST_DATA) + "/" + name;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  RefFile file;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("#", 0) == 0) {
      file.comments += line + "\n";
    } else if (line.rfind("== ", 0) == 0) {
      file.blocks.push_back({line.substr(3), {}});
    } else if (line.find("step ") != std::string::npos) {
      if (file.blocks.empty()) throw std::runtime_error(path + ": step line before a header");
      std::istringstream words(line);
      std::string word;
      RefStep step;
      words >> word >> step.step;
      std::string rest;
      std::getline(words, rest);
      for (size_t pos = 0; pos < rest.size();) {
        if (rest[pos] == ' ') {
          ++pos;
          continue;
        }
        size_t eq = rest.find('=', pos);
        if (eq == std::string::npos) throw std::runtime_error(path + ": bad step line: " + line);
        std::string key = rest.substr(pos, eq - pos);
        pos = eq + 1;
        if (rest[pos] == '[') {
          step.values[key] = parse_list(rest, pos);
        } else {
          size_t used = 0;
          step.values[key] = NumberList{{std::stod(rest.substr(pos), &used)}, {1}};
          pos += used;
        }
      }
      file.blocks.back().steps.push_back(std::move(step));
    } else if (!line.empty()) {
      throw std::runtime_error(path + ": unexpected line: " + line);
    }
  }
  return file;
}

/// True when every element of `actual` is within `rel` relative error of `expected`.
inline ::testing::AssertionResult close(const at::Tensor& actual, const NumberList& expected,
                                        double rel) {
  at::Tensor a = actual.detach().to(at::kCPU, at::kDouble).reshape(-1);
  if (a.numel() != static_cast<int64_t>(expected.values.size()))
    return ::testing::AssertionFailure()
           << "size " << a.numel() << " vs " << expected.values.size();
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a[i].item<double>(), e = expected.values[i];
    if (!(std::abs(x - e) <= rel * std::abs(e)))
      return ::testing::AssertionFailure()
             << "element " << i << ": " << x << " vs expected " << e << " (relative error "
             << std::abs(x - e) / std::abs(e) << " > " << rel << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace fbt
