// Picks the training device: the CPU, or the local rank's own GPU.
#include "fusebox/core/device.h"

#include <ATen/Context.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "fusebox/error.h"

namespace fusebox {

int gpu_for_local_rank(int local_rank, int local_world_size, int visible_gpus) {
  if (visible_gpus <= 0)
    throw Error(
        "--device cuda: this LibTorch has no CUDA support or no GPU is visible (nvidia-smi lists "
        "the GPUs); train with --device cpu");
  if (local_rank < 0 || local_rank >= visible_gpus) {
    const std::string n = std::to_string(visible_gpus);
    throw Error("--device cuda: local rank " + std::to_string(local_rank) + " of " +
                std::to_string(local_world_size) + " on this machine has no GPU of its own (" + n +
                " visible): start at most " + n +
                " processes per machine (--nproc-per-node), or check CUDA_VISIBLE_DEVICES and "
                "LOCAL_RANK");
  }
  return local_rank;
}

int visible_gpus() {
  // Through LibTorch's hooks, not c10::cuda: a CUDA LibTorch runs fusebox on the GPU even when
  // fusebox itself was built without nvcc (FUSEBOX_WITH_CUDA off).
  return at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0;
}

c10::Device select_device(const DeviceRequest& request) {
  if (request.kind == "cpu") return c10::Device(c10::kCPU);
  if (request.kind != "cuda")
    throw Error("--device " + request.kind + ": unknown device; use cpu or cuda");
  const int index =
      gpu_for_local_rank(request.local_rank, request.local_world_size, visible_gpus());
  const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
  return device;
}

}  // namespace fusebox
