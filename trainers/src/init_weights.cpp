#include "init_weights.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include "fusebox/core/checkpoint.h"
#include "fusebox/core/safetensors.h"
#include "fusebox/error.h"
#include "model.h"
#include "tensor_file.h"

namespace fusebox::trainer {

namespace {

using Named = std::vector<std::pair<std::string, at::Tensor>>;

// The line a crash of LibTorch's reader on `file` gets.
std::string crash_line(const std::string& file) {
  return "--init-weights: " + file +
         " cannot be read: LibTorch's reader crashed on it (a malformed file); write it again "
         "with --save-model or torch.save(model.state_dict(), path)";
}

// Every tensor the file holds, by name; `step` is set for a checkpoint.
std::map<std::string, at::Tensor> read_saved(const std::string& path, int64_t* step) {
  // A model in several files: the index names each tensor's file (safetensors, or torch.save'd
  // files for a .bin.index.json).
  if (is_safetensors_index_path(path)) return map_safetensors_index(path);
  if (is_weights_index_path(path))
    return map_weights_index(path, [&](const std::filesystem::path& file) {
      return read_tensor_file(file.string(), read_file_head(file), crash_line(file.string()));
    });
  const std::string head = read_file_head(path);
  if (looks_like_checkpoint(head)) {
    Checkpoint ckpt = load_checkpoint(path);  // its own reader: checks every length
    if (auto it = ckpt.counters.find("step"); it != ckpt.counters.end()) *step = it->second;
    std::map<std::string, at::Tensor> all = std::move(ckpt.model);
    all.insert(ckpt.buffers.begin(), ckpt.buffers.end());
    return all;
  }
  // A safetensors file is mapped: each tensor's pages are read as it is copied into the model.
  return read_tensor_file(path, head, crash_line(path));
}

// "'a', 'b' and 3 more"
std::string some_names(const std::vector<std::string>& names) {
  std::string out;
  const size_t shown = std::min<size_t>(names.size(), 3);
  for (size_t i = 0; i < shown; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > shown) out += " and " + std::to_string(names.size() - shown) + " more";
  return out;
}

// The checks of one saved tensor against the model's; `what` is "parameter" or "buffer".
void check_one(const std::string& path, const std::string& what, const std::string& name,
               const at::Tensor& saved, const at::Tensor& live) {
  const std::string where = "--init-weights: " + path + ": " + what + " '" + name + "'";
  if (saved.sizes() != live.sizes())
    throw Error(where + " has shape " + c10::str(saved.sizes()) + ", this model's has " +
                c10::str(live.sizes()) +
                ": the file is for another model or other sizes (--model-width, --model-depth, "
                "...)");
  if (c10::isFloatingType(saved.scalar_type()) != c10::isFloatingType(live.scalar_type()))
    throw Error(where + " is " + c10::toString(saved.scalar_type()) + ", this model's is " +
                c10::toString(live.scalar_type()) +
                ": an integer tensor and a floating one are not the same weights");
  if (c10::isFloatingType(saved.scalar_type()) && !all_finite(saved))
    throw Error(where +
                " holds values that are not finite (NaN or Inf): the run that wrote it "
                "diverged; start from an earlier file");
}

// A DistributedDataParallel wrapper saves its module's names under "module.", torch.compile's
// under "_orig_mod." (or both): when every name of the file carries such a prefix and none is the
// model's as it stands, the prefixes are removed. Returns what was removed ("" if nothing).
std::string strip_wrapper_prefixes(std::map<std::string, at::Tensor>& saved,
                                   const std::set<std::string>& known) {
  for (const auto& [name, t] : saved)
    if (known.count(name)) return "";
  std::string removed;
  for (bool again = true; again && !saved.empty();) {
    again = false;
    for (const std::string prefix : {"module.", "_orig_mod."}) {
      const bool all = std::all_of(saved.begin(), saved.end(), [&](const auto& entry) {
        return entry.first.size() > prefix.size() && entry.first.rfind(prefix, 0) == 0;
      });
      if (!all) continue;
      std::map<std::string, at::Tensor> stripped;
      for (auto& [name, t] : saved) stripped.emplace(name.substr(prefix.size()), std::move(t));
      saved = std::move(stripped);
      removed += prefix;
      again = true;
    }
  }
  return removed;
}

}  // namespace

std::string load_initial_weights(const std::string& path, Model& model, bool strict) {
  int64_t step = -1;
  std::map<std::string, at::Tensor> saved;
  try {
    saved = read_saved(path, &step);
  } catch (const Error& e) {
    throw Error(std::string("--init-weights: ") + e.what() +
                "; give a --save-model file, a .safetensors file, a torch.save'd state_dict or a "
                "fusebox checkpoint");
  }
  const Named params = model.parameters(), buffers = model.buffers();
  std::set<std::string> known;
  for (const Named* list : {&params, &buffers})
    for (const auto& [name, t] : *list) known.insert(name);
  const std::string removed = strip_wrapper_prefixes(saved, known);

  std::vector<std::string> unknown, missing;
  for (const auto& [name, t] : saved)
    if (!known.count(name)) unknown.push_back(name);
  for (const auto& [name, t] : params)
    if (!saved.count(name)) missing.push_back(name);
  // A file that shares no parameter with the model is the wrong file, strict or not.
  const bool disjoint = missing.size() == params.size();
  if (!unknown.empty() && (strict || disjoint)) {
    throw Error(
        "--init-weights: " + path + " holds " + some_names(unknown) +
        (removed.empty() ? "" : " (its names without a wrapper's prefix '" + removed + "')") +
        ", which this model has no parameter or buffer of: is it the weights of another "
        "model? (--list-params shows this model's names)");
  }
  if (!missing.empty() && (strict || disjoint))
    throw Error("--init-weights: " + path + " has no " + some_names(missing) +
                " of this model's parameters: is it the weights of another model or other "
                "sizes? (--list-params shows this model's names" +
                (disjoint ? ")"
                          : "; --init-weights-strict=false keeps the initialisation of "
                            "parameters the file lacks)"));

  // Every check before the first copy: a refused file leaves the model as it was.
  size_t buffers_taken = 0;
  for (const auto& [name, p] : params)
    if (auto it = saved.find(name); it != saved.end())
      check_one(path, "parameter", name, it->second, p);
  for (const auto& [name, b] : buffers)
    if (auto it = saved.find(name); it != saved.end()) {
      check_one(path, "buffer", name, it->second, b);
      ++buffers_taken;
    }
  at::NoGradGuard no_grad;
  for (const Named* list : {&params, &buffers})
    for (const auto& [name, t] : *list)
      if (auto it = saved.find(name); it != saved.end()) t.copy_(it->second);

  auto count = [](size_t n, const std::string& what) {
    return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
  };
  std::vector<std::string> buffers_kept;
  for (const auto& [name, b] : buffers)
    if (!saved.count(name)) buffers_kept.push_back(name);
  std::string out =
      path + (step >= 0 ? " (the model of checkpoint step " + std::to_string(step) + ")" : "") +
      ": " + count(params.size() - missing.size(), "parameter tensor");
  if (buffers_taken > 0) out += ", " + count(buffers_taken, "buffer");
  if (!removed.empty()) out += " (the file's names lose a wrapper's prefix '" + removed + "')";
  if (!missing.empty())
    out += "; initialised by the model (not in the file): " + some_names(missing);
  if (!buffers_kept.empty())
    out += "; buffers as the model holds them (not in the file): " + some_names(buffers_kept);
  if (!unknown.empty()) out += "; left unused (not in the model): " + some_names(unknown);
  return out;
}

}  // namespace fusebox::trainer
