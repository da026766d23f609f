// Checkpoints that survive being killed mid-write, and model weights Python can read.
//
// A checkpoint file is a small header (magic, format version, payload size, FNV-1a checksum)
// followed by a payload of named entries (raw tensors with dtype and shape, strings, integers),
// decoded with every length checked: a corrupt or crafted file is an Error, never a crash.
// (LibTorch 1.13's pickle reader can read out of bounds on a crafted file, so it is used only for
// model weights meant for Python.) It is written to a temporary file in the same
// folder, flushed, fsynced and renamed over the target, so an interrupted write never replaces
// the last good checkpoint; the checksum catches truncation and corruption before any parsing.
// Optimizer state is keyed by parameter name, so a checkpoint saved with N optimizer groups
// resumes with another N, fused or normal mode (for per-parameter plugins).
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fusebox/optimizer.h"

namespace fusebox {

/// Everything needed to continue a run exactly.
struct Checkpoint {
  std::map<std::string, at::Tensor> model;    ///< parameter name -> values
  std::map<std::string, at::Tensor> buffers;  ///< model buffers (running statistics), by name
  StateDict optimizer;                        ///< merged state of every optimizer instance
  std::map<std::string, std::string> meta;    ///< plugin, plugin_version, mode, config, ...
  std::map<std::string, int64_t> counters;    ///< step, scheduler_steps, ...
  std::map<std::string, at::Tensor> rng;      ///< generator states ("cpu", "cuda:0", ...)
  std::map<std::string, at::Tensor> ema;      ///< parameter averages (ParameterEma), by name
};

/// Writes `ckpt` to `path` atomically (temp file + fsync + rename). Throws Error naming the path.
/// Streamed: besides a 1 MiB buffer it holds one tensor's CPU copy at a time (none for CPU
/// tensors), never the encoded checkpoint.
void save_checkpoint(const Checkpoint& ckpt, const std::filesystem::path& path);

/// The bytes save_checkpoint() writes (e.g. to send a checkpoint's parts between ranks).
std::string encode_checkpoint(const Checkpoint& ckpt);
/// Reads a checkpoint; a missing, truncated, corrupt or foreign file throws one-line Error. The
/// file is mapped (copy-on-write) and the tensors view it, so loading allocates no memory for
/// them: restoring copies them where they belong, and the file's pages are the system's to drop.
/// The file stays mapped while a tensor of it lives (it must not be shortened meanwhile; replacing
/// or deleting it is fine). Tensors of format version 1 files (fusebox 0.6 and earlier) are copied.
Checkpoint load_checkpoint(const std::filesystem::path& path);
/// Decodes the bytes of a checkpoint file; `where` names it in errors (load_checkpoint's core).
Checkpoint parse_checkpoint(const std::string& bytes, const std::string& where);

/// The state of all `optimizers`, merged into one name-keyed dict (clones, safe to keep).
StateDict merged_optimizer_state(const std::vector<std::shared_ptr<Optimizer>>& optimizers);
/// The same without copies: what the optimizers' state_dict() give, mostly their own tensors,
/// which their next step changes. For a checkpoint written at once: cloning would hold a second
/// copy of the optimizer state while it is written.
StateDict optimizer_state_now(const std::vector<std::shared_ptr<Optimizer>>& optimizers);

/// The part of a merged dict that ZeRO-1 rank `rank` of `world` keeps: optimizer-wide entries and
/// the state of the parameters parameter_owners() gives it (`groups` as given to the step mode).
StateDict owned_optimizer_state(const StateDict& merged, const std::vector<ParamGroup>& groups,
                                int rank, int world);

/// Loads a merged dict into `optimizers` (any grouping); throws if it holds state for a parameter
/// none of them owns or one of them refuses it, and then no optimizer has changed.
void load_merged_optimizer_state(const std::vector<std::shared_ptr<Optimizer>>& optimizers,
                                 const StateDict& state);

/// Copies saved values into `params` (name -> tensor), checking names, shapes and float width
/// (float64 against float32 is refused; bf16 against float32 is not); throws Error naming the
/// first difference.
void restore_parameters(const std::map<std::string, at::Tensor>& saved,
                        const std::vector<std::pair<std::string, at::Tensor>>& params);
/// The same for a model's buffers (Checkpoint::buffers).
void restore_buffers(const std::map<std::string, at::Tensor>& saved,
                     const std::vector<std::pair<std::string, at::Tensor>>& buffers);

/// States of the default generators (CPU, and each CUDA device when present).
std::map<std::string, at::Tensor> capture_rng_state();
/// Restores what capture_rng_state() returned.
void restore_rng_state(const std::map<std::string, at::Tensor>& states);

/// Writes named tensors in torch's pickle format (torch.save/torch.load compatible: in Python,
/// `torch.load(path)` returns a dict of tensors), atomically.
void save_model_weights(const std::vector<std::pair<std::string, at::Tensor>>& params,
                        const std::filesystem::path& path);
/// Reads what save_model_weights() or Python's torch.save of a dict of tensors wrote. The file is
/// mapped when its records can be viewed as they are (what PyTorch writes; `*mapped` says so):
/// the tensors view its pages, copy-on-write, and hold the mapping.
std::map<std::string, at::Tensor> load_model_weights(const std::filesystem::path& path,
                                                     bool* mapped = nullptr);

/// A file's first `n` bytes (fewer if it is shorter or cannot be read), to tell formats apart.
std::string read_file_head(const std::filesystem::path& path, size_t n = 16);
/// True if `head`, a file's first bytes, starts like a fusebox checkpoint.
bool looks_like_checkpoint(const std::string& head);

/// Writes `bytes` to `path` atomically: temp file in the same folder, fsync, rename, fsync folder.
void write_file_atomically(const std::filesystem::path& path, const std::string& bytes);
/// Appends `bytes` to `path` (created if missing) and fsyncs it. If the write fails (a full disk,
/// a size limit), the file is cut back to its earlier length, so it never ends in part of `bytes`.
void append_to_file(const std::filesystem::path& path, const std::string& bytes);

/// Where `target` is written before it is renamed into place: ".<name>.tmp.<pid>" beside it.
std::filesystem::path temporary_path(const std::filesystem::path& target);
/// Checkpoint file name for a step: "checkpoint-00000120.fbx".
std::string checkpoint_name(int64_t step);
/// The step of a checkpoint file name, or nothing for another name.
std::optional<int64_t> checkpoint_step(const std::filesystem::path& file);
/// Whether `name` is one of the files fusebox writes into an output folder: a checkpoint, the
/// latest-checkpoint pointer, metrics.jsonl, metrics.csv, summary.json or comparison.txt.
bool is_output_file_name(const std::string& name);
/// Checkpoints in `dir`, oldest first (by step number in the name).
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& dir);
/// Deletes temporaries (temporary_path) of fusebox's output files (checkpoints, metrics,
/// summary, comparison) in `dir` whose writing process no longer exists.
void remove_stale_temporaries(const std::filesystem::path& dir);
/// Records `checkpoint` as the one written last in its folder (a small "latest-checkpoint" file,
/// written atomically after the checkpoint itself).
void mark_latest_checkpoint(const std::filesystem::path& checkpoint);
/// The checkpoint in `dir` written last: the one "latest-checkpoint" names when it exists,
/// otherwise the highest step; nothing when there is none. Not simply the highest step: a folder
/// may also hold an earlier run's checkpoints of later steps than the run interrupted there.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& dir);
/// Deletes stale temporaries and, of the checkpoints in `dir` up to step `newest_step` (the one
/// just written), all but the newest `keep` (keep <= 0: keep all). Checkpoints of later steps
/// are another run's and are left alone.
void prune_checkpoints(const std::filesystem::path& dir, int64_t keep,
                       int64_t newest_step = std::numeric_limits<int64_t>::max());

}  // namespace fusebox
