# fusebox_cxx_standard(OUT_VAR REQUESTED std [CMAKE_REQUESTED std] VERSION torch_version
#                      INCLUDE_DIRS dir...)
# The C++ standard fusebox compiles in against the LibTorch that find_package(Torch) found.
#
# fusebox's own code is C++17 and compiles as C++20 too. C++17 is the default; a LibTorch whose
# headers need more gets more: PyTorch moved its C++ API to C++20, and its headers then refuse
# older modes (`#error C++20 or later compatible compiler is required to use ATen.` in
# ATen/ATen.h) and use C++20 syntax. So the guard in ATen/ATen.h decides, and LibTorch 2.12 or
# later, which PyTorch builds and compiles extensions with as C++20, gets C++20 whatever its guard
# says. REQUESTED (FUSEBOX_CXX_STANDARD; empty: choose) names a standard outright; one below what
# LibTorch needs stops the configuration with a message saying what to set. CMAKE_REQUESTED is a
# CMAKE_CXX_STANDARD given on the command line (or in the cache), the usual CMake way to ask: it
# counts as a request when FUSEBOX_CXX_STANDARD is empty, and is checked the same way.
function(fusebox_cxx_standard out_var)
  cmake_parse_arguments(ARG "" "REQUESTED;CMAKE_REQUESTED;VERSION" "INCLUDE_DIRS" ${ARGN})
  set(asked_by FUSEBOX_CXX_STANDARD)
  set(or_not "or leave it empty")
  if("${ARG_REQUESTED}" STREQUAL "" AND NOT "${ARG_CMAKE_REQUESTED}" STREQUAL "")
    set(ARG_REQUESTED "${ARG_CMAKE_REQUESTED}")
    set(asked_by CMAKE_CXX_STANDARD)
    set(or_not "or leave it out")
  endif()
  set(needed 17)
  set(reason "fusebox's baseline")
  foreach(dir IN LISTS ARG_INCLUDE_DIRS)
    if(EXISTS "${dir}/ATen/ATen.h")
      # The guard reads `__cplusplus < 201703L` (C++17), `< 202002L` (C++20), ...
      file(STRINGS "${dir}/ATen/ATen.h" guard REGEX "__cplusplus < 20[0-9][0-9][0-9][0-9]L")
      if(guard MATCHES "__cplusplus < 20([0-9][0-9])")
        if(CMAKE_MATCH_1 GREATER needed)
          set(needed ${CMAKE_MATCH_1})
          set(reason "its ATen/ATen.h refuses older modes")
        endif()
      endif()
      break()
    endif()
  endforeach()
  if("${ARG_VERSION}" VERSION_GREATER_EQUAL 2.12 AND needed LESS 20)
    set(needed 20)
    set(reason "PyTorch builds LibTorch 2.12 and later, and their extensions, as C++20")
  endif()

  if("${ARG_REQUESTED}" STREQUAL "")
    set(${out_var} ${needed} PARENT_SCOPE)
    return()
  endif()
  if(NOT ARG_REQUESTED MATCHES "^(17|20|23)$")
    message(FATAL_ERROR "${asked_by}=${ARG_REQUESTED}: use 17, 20 or 23, ${or_not} "
      "to choose from LibTorch")
  endif()
  if(ARG_REQUESTED LESS needed)
    message(FATAL_ERROR "${asked_by}=${ARG_REQUESTED}: LibTorch ${ARG_VERSION} needs "
      "C++${needed} (${reason}); set -D${asked_by}=${needed} ${or_not}")
  endif()
  set(${out_var} ${ARG_REQUESTED} PARENT_SCOPE)
endfunction()
