# CUDA kernels of the Adam/AdamW and Adafactor plugins (update_kernels.cu); included by
# plugins/CMakeLists.txt, so CUDA is enabled in the directory of the plugins that link them.
#
# The kernels use only the CUDA toolkit (pointers, sizes, scalars, a stream), so they are compiled
# whenever nvcc works, even against a CPU-only LibTorch: that proves they build. The plugins link
# them and dispatch to them only when LibTorch has CUDA too (FUSEBOX_HAVE_CUDA).
#
# fusebox_cuda_math (header only, always defined): the per-element math shared with the CPU tests.
add_library(fusebox_cuda_math INTERFACE)
target_include_directories(fusebox_cuda_math INTERFACE ${CMAKE_CURRENT_LIST_DIR})

set(FUSEBOX_CUDA_KERNELS OFF)
if(FUSEBOX_CUDA STREQUAL "OFF")
  return()
endif()
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(FUSEBOX_CUDA STREQUAL "ON")
    message(FATAL_ERROR "FUSEBOX_CUDA=ON but no working CUDA compiler was found (set CUDACXX or "
      "CMAKE_CUDA_COMPILER; with a host compiler nvcc does not support, set "
      "CMAKE_CUDA_HOST_COMPILER or CMAKE_CUDA_FLAGS=-allow-unsupported-compiler)")
  endif()
  message(STATUS "fusebox: no working CUDA compiler; CUDA kernels not built")
  return()
endif()
# Ampere and Hopper by default (CUDA 13 supports sm_75 and newer); override with
# -DCMAKE_CUDA_ARCHITECTURES=... A CUDA LibTorch turns this off and uses TORCH_CUDA_ARCH_LIST.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 80 90)
endif()
if(CCACHE_PROGRAM AND NOT CMAKE_CUDA_COMPILER_LAUNCHER)
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
# nvcc's host compiler can be another GCC than the C++ compiler that links (Debian 13: nvcc 12.4
# runs gcc-13, c++ is gcc-14). Its library folder would then hand that link an older libstdc++
# (undefined __cxa_call_terminate); the linking compiler knows its own folders.
list(FILTER CMAKE_CUDA_IMPLICIT_LINK_DIRECTORIES EXCLUDE REGEX "/gcc/")
# A CUDA LibTorch's package sets CMAKE_CUDA_ARCHITECTURES to OFF and puts its own -gencode list
# (TORCH_CUDA_ARCH_LIST) into CMAKE_CUDA_FLAGS; the kernels are then built for those.
set(_fusebox_archs "${CMAKE_CUDA_ARCHITECTURES}")
if(NOT CMAKE_CUDA_ARCHITECTURES)
  set(_fusebox_archs "LibTorch's -gencode list")
endif()
message(STATUS "fusebox: CUDA kernels with nvcc ${CMAKE_CUDA_COMPILER_VERSION}, "
  "architectures ${_fusebox_archs}")

add_library(fusebox_cuda_kernels STATIC ${CMAKE_CURRENT_LIST_DIR}/update_kernels.cu)
target_link_libraries(fusebox_cuda_kernels PUBLIC fusebox_cuda_math CUDA::cudart)
set_target_properties(fusebox_cuda_kernels PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  # LibTorch links the shared CUDA runtime; one runtime per process.
  CUDA_RUNTIME_LIBRARY Shared
  CXX_VISIBILITY_PRESET hidden
  CUDA_VISIBILITY_PRESET hidden)
# Directory-wide options (FUSEBOX_SANITIZE's -fsanitize=...) are host-compiler flags nvcc rejects.
set_property(TARGET fusebox_cuda_kernels PROPERTY COMPILE_OPTIONS "")
target_compile_options(fusebox_cuda_kernels PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
set(FUSEBOX_CUDA_KERNELS ON)
