// AdamW with 8-bit moments: block-wise dynamic quantization after Dettmers et al. (2022), "8-bit
// Optimizers via Block-wise Quantization" (bitsandbytes' AdamW8bit). Each moment takes one byte
// per element instead of four, so AdamW's state shrinks to about a quarter of its float32 size.
//
// A moment is cut into blocks of block_size elements; a block keeps its scale in float32 (the
// largest |m|, the largest v) and each element the index of the nearest of 256 values of a
// dynamic map: a decimal exponent and a linear fraction, so the codes cover seven orders of
// magnitude below the block's scale instead of the two that linear int8 would. The step itself is
// AdamW's (the SDK's adam_step_), in float32, from the dequantized moments; only their storage is
// 8-bit. Tensors smaller than min_8bit_size keep float32 moments: biases and norms weigh nothing
// and are the most sensitive to rounding.
#include <fusebox/sdk.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

// The 256 values of the dynamic map, ascending: for each decimal exponent e = -6..0, equal steps
// of the fraction [0.1, 1] (1, 2, 4, ... 64 of them signed, twice as many unsigned), then 0 and 1.
std::vector<float> dynamic_map(bool is_signed) {
  std::vector<float> values{0.0f, 1.0f};
  for (int e = 0; e < 7; ++e) {
    const int steps = is_signed ? 1 << e : 2 << e;
    for (int k = 0; k < steps; ++k) {
      const double fraction = 0.1 + 0.9 * (k + 0.5) / steps;
      const float v = static_cast<float>(fraction * std::pow(10.0, e - 6));
      values.push_back(v);
      if (is_signed) values.push_back(-v);
    }
  }
  std::sort(values.begin(), values.end());
  return values;
}

// One moment in 8 bits: the map (on the moment's device) and the midpoints between its values.
struct Codebook {
  at::Tensor values, midpoints;
  int64_t zero = 0;  // the index of 0 in values
};

class AdamW8bit final : public fusebox::Optimizer {
 public:
  static void declare_schema(fusebox::Schema& s) {
    s.real("lr", 1e-3, "learning rate").above(0);
    s.real_pair("betas", {0.9, 0.999}, "decay of the first and second moments")
        .at_least(0)
        .below(1);
    s.real("eps", 1e-8, "added to the denominator").at_least(0);
    s.real("weight_decay", 1e-2, "decoupled weight decay: θ ← θ·(1 - lr·wd) before the moments")
        .at_least(0);
    s.integer("block_size", 256, "elements per quantization block (each has a float32 scale)")
        .at_least(16)
        .at_most(65536);
    s.integer("min_8bit_size", 4096, "tensors with fewer elements keep float32 moments")
        .at_least(0);
    s.flag("stochastic_rounding", false, "round bf16 parameters stochastically on write-back");
  }

  AdamW8bit(std::vector<fusebox::ParamGroup> groups, const fusebox::HyperParams& hp)
      : Optimizer(std::move(groups), hp),
        beta1_(hp.real_pair("betas").first),
        beta2_(hp.real_pair("betas").second),
        eps_(hp.real("eps")),
        weight_decay_(hp.real("weight_decay")),
        block_(hp.integer("block_size")),
        min_8bit_(hp.integer("min_8bit_size")),
        stochastic_(hp.flag("stochastic_rounding")) {}

 protected:
  void update_param(const at::Tensor& param, fusebox::ParamState& state, size_t group) override {
    at::Tensor p = fusebox::fp32_view(param);
    at::Tensor g = param.grad().to(p.scalar_type());
    // The moments in float32, from whichever form the state holds (a checkpoint may come from
    // another block_size or min_8bit_size: it is read in its own layout and stored in this one).
    at::Tensor m = moment(state, "exp_avg", p, true), v = moment(state, "exp_avg_sq", p, false);
    ++state.step;
    const double lr = this->lr(group);
    if (weight_decay_ != 0) p.mul_(1.0 - lr * weight_decay_);
    fusebox::adam_step_(p, g, m, v, at::Tensor(), state.step, lr, beta1_, beta2_, eps_);
    store(state, "exp_avg", m, true);
    store(state, "exp_avg_sq", v, false);
    fusebox::write_back(param, p, stochastic_, rounding_seed(param));
  }

 private:
  bool quantized(const at::Tensor& p) const { return p.numel() >= min_8bit_; }

  // The map of signed (first moment) or unsigned (second moment) values on `device`; made once
  // per device (the fused backward pass may call from autograd's thread of each device).
  const Codebook& codebook(bool is_signed, const at::Device& device) {
    const std::lock_guard<std::mutex> lock(mutex_);
    Codebook& book = books_[std::make_pair(is_signed, device.str())];
    if (!book.values.defined()) {
      const std::vector<float> map = dynamic_map(is_signed);
      const at::Tensor values = at::tensor(map, at::TensorOptions().dtype(at::kFloat));
      book.values = values.to(device);
      book.midpoints = ((values.slice(0, 1) + values.slice(0, 0, -1)) / 2).to(device);
      book.zero = std::find(map.begin(), map.end(), 0.0f) - map.begin();
    }
    return book;
  }

  // The float32 moment `key` of a parameter like `p`: zeros at the first step, the float32 state
  // as it is, or the 8-bit codes ([blocks, block size], uint8) times their blocks' scales.
  at::Tensor moment(fusebox::ParamState& state, const std::string& key, const at::Tensor& p,
                    bool is_signed) {
    if (state.tensors.count(key)) return state[key];
    const auto codes = state.tensors.find(key + "_codes");
    const auto scale = state.tensors.find(key + "_scale");
    if (codes == state.tensors.end() || scale == state.tensors.end()) return at::zeros_like(p);
    const at::Tensor& c = codes->second;
    if (c.dim() != 2 || c.scalar_type() != at::kByte || c.numel() < p.numel() ||
        scale->second.numel() != c.size(0))
      throw fusebox::Error("adamw8bit: the state '" + key +
                           "_codes' does not fit this parameter (a corrupt state dict?)");
    const Codebook& book = codebook(is_signed, p.device());
    // In the working precision of `p` (float32, or float64 for a double parameter).
    return book.values.index_select(0, c.reshape({-1}).to(at::kLong))
        .to(p.scalar_type())
        .view(c.sizes())
        .mul_(scale->second.to(p.scalar_type()).unsqueeze(1))
        .reshape({-1})
        .slice(0, 0, p.numel())
        .view(p.sizes());
  }

  // Stores the float32 moment `m` under `key`: as it is for a small tensor, else as codes and
  // block scales. A positive second moment never becomes 0 (its code is at least the smallest
  // positive value): a zero would divide the update by eps alone.
  void store(fusebox::ParamState& state, const std::string& key, const at::Tensor& m,
             bool is_signed) {
    if (!quantized(m)) {
      state.tensors.erase(key + "_codes"), state.tensors.erase(key + "_scale");
      state[key] = m;
      return;
    }
    state.tensors.erase(key);
    const int64_t n = m.numel(), blocks = (n + block_ - 1) / block_;
    at::Tensor flat = m.reshape({-1});
    if (blocks * block_ != n) flat = at::constant_pad_nd(flat, {0, blocks * block_ - n}, 0);
    const at::Tensor rows = flat.view({blocks, block_});
    const at::Tensor scale = std::get<0>(rows.abs().max(1, /*keepdim=*/true));
    const at::Tensor normed = rows / at::where(scale > 0, scale, at::ones_like(scale));
    const Codebook& book = codebook(is_signed, m.device());
    at::Tensor index = at::bucketize(normed.to(at::kFloat), book.midpoints);
    if (!is_signed) index = at::where((normed > 0) & (index == book.zero), index + 1, index);
    state[key + "_codes"] = index.to(at::kByte);
    state[key + "_scale"] = scale.squeeze(1).contiguous();
  }

  double beta1_, beta2_, eps_, weight_decay_;
  int64_t block_, min_8bit_;
  bool stochastic_;
  std::mutex mutex_;
  std::map<std::pair<bool, std::string>, Codebook> books_;
};

}  // namespace

FUSEBOX_PLUGIN(AdamW8bit, "adamw8bit", "1.0.0",
               "AdamW with 8-bit block-wise quantized moments (a quarter of AdamW's state)",
               fusebox::kSupportsStepParam)
