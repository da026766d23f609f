// Model weights in the safetensors format, the one Hugging Face's libraries (diffusers,
// transformers) and most published checkpoints use: an 8-byte little-endian header size, a JSON
// header giving each tensor's dtype, shape and byte range, then the raw little-endian bytes.
//
// Reading runs no code from the file (unlike a pickle) and checks every size, range and name
// before it allocates: a truncated or crafted file is an Error naming it, never a crash or an
// allocation larger than the file.
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fusebox {

/// Tensors of unsigned integers kept in their signed carriers, by name: the type each widens into.
using UnsignedTypes = std::map<std::string, at::ScalarType>;

/// The file's bytes for `tensors` (moved to the CPU, made contiguous), with `metadata` as its
/// `__metadata__` (`format: pt` unless given). Tensors are laid out by decreasing element size,
/// then name, so every one starts aligned to its element size. Throws Error for a dtype the format
/// has no name for, or a name given twice.
std::string encode_safetensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                               const std::map<std::string, std::string>& metadata = {});

/// Writes encode_safetensors() to `path` atomically (temporary file, fsync, rename).
void save_safetensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::filesystem::path& path,
                      const std::map<std::string, std::string>& metadata = {});

/// Reads a safetensors file into CPU tensors by name; `metadata`, when given, receives its
/// `__metadata__`. Reads each tensor straight into its storage (no second copy of the file).
/// Unsigned U16 and U32 tensors, which LibTorch has no type for, are widened into int32 and int64
/// with their values unchanged (token ids of a large vocabulary); U64 and F8 are refused.
/// Throws Error naming the file and what is wrong.
std::map<std::string, at::Tensor> load_safetensors(
    const std::filesystem::path& path, std::map<std::string, std::string>* metadata = nullptr);

/// The same, with the file mapped into memory (copy-on-write) instead of read: each tensor views
/// its bytes in the mapping (one not aligned to its element size, BOOL, U16 or U32 is copied), so
/// the operating system reads pages as they are used and may drop them again: a file larger than
/// memory can be used, and processes that map one file share its pages. The file must not be
/// shortened while mapped (a page past its new end kills the process with SIGBUS).
///
/// With `unsigned_types`, U16 and U32 tensors are not widened: each is returned as its bytes lie,
/// in the signed type of its width (int16, int32; viewed in the mapping when aligned, like any
/// other tensor), and `(*unsigned_types)[name]` is the type widen_unsigned() makes of it (int32,
/// int64). A large uint16 token stream then costs no memory of its own; its reader widens what
/// it uses.
std::map<std::string, at::Tensor> map_safetensors(
    const std::filesystem::path& path, std::map<std::string, std::string>* metadata = nullptr,
    UnsignedTypes* unsigned_types = nullptr);

/// The values of an unsigned tensor kept in `carrier`, the signed type of its width (int16 for
/// uint16, int32 for uint32; negative carrier values are those at and above 2^(bits - 1)), as
/// `type` (int32 or int64): a new tensor.
at::Tensor widen_unsigned(const at::Tensor& carrier, at::ScalarType type);

/// The tensors of a model saved in several safetensors files (Hugging Face's sharded format): the
/// index, `NAME.safetensors.index.json`, maps each tensor's name ("weight_map") to the file beside
/// it that holds it. Each file is mapped as map_safetensors maps it. Throws Error naming the index
/// or file: a file name that is not beside the index, a tensor missing from its file, a tensor of
/// a file that the index does not list, and each fault of a file.
std::map<std::string, at::Tensor> map_safetensors_index(const std::filesystem::path& index);

/// Reads one file of a sharded model: its tensors by name.
using ShardReader =
    std::function<std::map<std::string, at::Tensor>(const std::filesystem::path& file)>;
/// The same for an index whose files `read_shard` reads: Hugging Face's sharded PyTorch format,
/// `NAME.bin.index.json` beside torch.save'd files (load_model_weights), has the same index.
std::map<std::string, at::Tensor> map_weights_index(const std::filesystem::path& index,
                                                    const ShardReader& read_shard);

/// The same for a file's bytes already in memory; `where` names them in errors.
std::map<std::string, at::Tensor> parse_safetensors(
    const std::string& bytes, const std::string& where,
    std::map<std::string, std::string>* metadata = nullptr);

/// True if `head`, a file's first bytes (at least 9), starts like a safetensors file: a header
/// size, then the header's opening brace.
bool looks_like_safetensors(const std::string& head);

/// True if `path` names a safetensors file (it ends in .safetensors).
bool is_safetensors_path(const std::filesystem::path& path);

/// True if `path` names a sharded safetensors index (it ends in .safetensors.index.json).
bool is_safetensors_index_path(const std::filesystem::path& path);
/// True if `path` names a sharded model's index: .safetensors.index.json, or .bin.index.json (and
/// .pt/.pth.index.json) for torch.save'd files.
bool is_weights_index_path(const std::filesystem::path& path);

}  // namespace fusebox
