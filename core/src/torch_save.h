// Reading a torch.save'd file (a zip archive of a pickle and one record per storage) by mapping it:
// its tensors view the file's pages instead of copies of it.
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <optional>
#include <string>

namespace fusebox::detail {

/// The dict of tensors torch.save (or torch::jit::pickle_save) wrote to `path`, each tensor a
/// view of the file mapped copy-on-write. Nothing when the file is not an archive whose records
/// can be viewed as they are (not a zip, a compressed record, another byte order, an unknown
/// format version): the caller reads it the usual way, which decodes it or says what is wrong.
/// Throws what the unpickler throws for a malformed pickle, and Error for a storage larger than
/// its record.
std::optional<std::map<std::string, at::Tensor>> map_torch_archive(
    const std::filesystem::path& path);

}  // namespace fusebox::detail
