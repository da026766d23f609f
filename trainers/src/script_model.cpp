// A TorchScript module as a model: forward(batch) returns the scalar loss.
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/script.h>

#include <sstream>

#include "fusebox/core/checkpoint.h"
#include "fusebox/core/messages.h"
#include "fusebox/core/safetensors.h"
#include "fusebox/error.h"
#include "launch.h"
#include "model.h"
#include "read_crash_guard.h"

namespace fusebox::trainer {

namespace {

// The line of a TorchScript error that says what went wrong: the interpreter's message starts
// with "The following operation failed ..." and a traceback, and ends with the error itself.
std::string script_error(const std::string& what) {
  if (what.rfind("The following operation failed in the TorchScript interpreter", 0) != 0)
    return first_line(what);
  std::string last, line;
  std::istringstream in(what);
  while (std::getline(in, line))
    if (line.find_first_not_of(" \t") != std::string::npos) last = line;
  return last.substr(last.find_first_not_of(" \t"));
}

class ScriptModel : public Model {
 public:
  ScriptModel(torch::jit::Module m, std::string path)
      : m_(std::move(m)),
        path_(std::move(path)),
        takes_arguments_(m_.get_method("forward").function().getSchema().arguments().size() > 1) {}

  std::vector<std::pair<std::string, at::Tensor>> parameters() override {
    std::vector<std::pair<std::string, at::Tensor>> named;
    // Integer parameters (indices, counters) take no gradient: they are not trained.
    for (const auto& p : m_.named_parameters(/*recurse=*/true))
      if (p.value.is_floating_point()) named.emplace_back(p.name, p.value);
    return unique_parameters(std::move(named));
  }

  std::vector<std::pair<std::string, at::Tensor>> buffers() override {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& b : m_.named_buffers(/*recurse=*/true))
      if (b.value.defined()) named.emplace_back(b.name, b.value);
    // Integer parameters are not trained but are state all the same (a counter): saved, restored
    // and shared like buffers.
    for (const auto& p : m_.named_parameters(/*recurse=*/true))
      if (p.value.defined() && !p.value.is_floating_point()) named.emplace_back(p.name, p.value);
    return named;
  }

  void set_training(bool on) override { m_.train(on); }

  std::vector<ForwardArgument> forward_arguments() override {
    std::vector<ForwardArgument> out;
    const auto& arguments = m_.get_method("forward").function().getSchema().arguments();
    for (size_t i = 1; i < arguments.size(); ++i)  // the first is self
      out.push_back({arguments[i].name(), arguments[i].default_value().has_value()});
    return out;
  }

  at::Tensor loss(const Batch& b) override {
    c10::IValue out;
    try {
      if (!takes_arguments_) {
        out = m_.forward({});  // a module that makes its own data (--dataset none)
      } else if (b.arguments.empty()) {
        out = m_.forward({b.input});
      } else {
        torch::jit::Kwargs kwargs;
        for (const auto& [name, t] : b.arguments) kwargs.emplace(name, t);
        out = m_.forward({}, kwargs);
      }
    } catch (const std::exception& e) {
      throw Error("model script " + path_ + ": forward failed: " + script_error(e.what()));
    }
    if (!out.isTensor())
      throw Error("model script " + path_ + ": forward must return a tensor (the loss), got " +
                  out.tagKind());
    at::Tensor loss = out.toTensor();
    if (loss.numel() != 1)
      throw Error("model script " + path_ + ": forward must return a scalar loss, got shape " +
                  c10::str(loss.sizes()));
    return loss.reshape({});
  }

  std::string describe() override {
    auto params = parameters();
    return "script " + path_ + ": " + std::to_string(count_elements(params)) + " parameters in " +
           std::to_string(params.size()) + " tensors";
  }

  void save(const std::string& path, std::optional<c10::ScalarType> as) override {
    // .safetensors: the module's state_dict (parameters and buffers), for loaders of that format.
    if (is_safetensors_path(path)) {
      auto named = parameters();
      for (auto& b : buffers()) named.push_back(std::move(b));
      write_weights(named, path, as);
      return;
    }
    save_via_temporary(path, [&](const std::string& tmp) { m_.save(tmp); });
  }

 private:
  torch::jit::Module m_;
  std::string path_;
  bool takes_arguments_;  ///< forward has arguments besides self
};

// Reads the module, or throws Error saying why it cannot be.
torch::jit::Module read_script(const std::string& path, c10::Device device) {
  const ReadCrashGuard guard(error_line("model script " + path +
                                        " cannot be loaded: LibTorch's reader crashed on it (a "
                                        "malformed TorchScript file); save the module again with "
                                        "torch.jit.save"));
  try {
    return torch::jit::load(path, device);
  } catch (const std::exception& e) {
    bool weights = false;  // a --save-model (or torch.save, or safetensors) dict of tensors
    try {
      weights = looks_like_safetensors(read_file_head(path)) || !load_model_weights(path).empty();
    } catch (const std::exception&) {
    }
    throw Error(
        "model script " + path + " cannot be loaded: " +
        (weights ? std::string("it holds model weights (a --save-model, torch.save or "
                               "safetensors file), not a TorchScript module whose forward(batch) "
                               "returns the loss")
                 : first_line(e.what())));
  }
}

}  // namespace

std::unique_ptr<Model> load_script_model(const std::string& path, c10::Device device,
                                         c10::ScalarType dtype) {
  // The graph executor re-optimizes a script after its first calls, and the optimized graph may
  // round differently: a resumed run would then differ from an uninterrupted one at the same
  // step. Running every call unoptimized keeps results independent of the call count.
  torch::jit::setGraphExecutorOptimize(false);
  torch::jit::Module m = read_script(path, device);
  if (!m.find_method("forward"))
    throw Error("model script " + path +
                " has no forward method: it must be a TorchScript module whose forward(batch) "
                "returns the loss");
  // Only floating-point tensors take --dtype (Module::to would turn index and counter buffers
  // into floats too); set_data changes them in place, as Module::to does.
  {
    at::NoGradGuard no_grad;
    for (const auto& p : m.parameters(/*recurse=*/true))
      if (p.is_floating_point()) p.set_data(p.to(dtype));
    for (const auto& b : m.buffers(/*recurse=*/true))
      if (b.defined() && b.is_floating_point()) b.set_data(b.to(dtype));
  }
  m.train();
  for (const auto& p : m.parameters(/*recurse=*/true))
    if (p.is_floating_point()) p.set_requires_grad(true);
  auto model = std::make_unique<ScriptModel>(std::move(m), path);
  if (model->parameters().empty())
    throw Error("model script " + path + " has no parameters to train");
  return model;
}

}  // namespace fusebox::trainer
