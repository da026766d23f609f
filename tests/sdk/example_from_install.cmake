# cmake -DFUSEBOX_BUILD_DIR=... -DEXAMPLE_SOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=...
#       [-DCXX_COMPILER=...] [-DCOMPILER_LAUNCHER=...] [-DTORCH_DIR=...] -DWITH_TRAINER=ON|OFF
#       -P example_from_install.cmake
# Installs fusebox into WORK_DIR/prefix, builds the example plugin against that prefix only, runs
# its conformance test and (WITH_TRAINER) trains with it through the installed trainer.
cmake_minimum_required(VERSION 3.18)
foreach(v FUSEBOX_BUILD_DIR EXAMPLE_SOURCE_DIR WORK_DIR GENERATOR)
  if(NOT ${v})
    message(FATAL_ERROR "example_from_install.cmake: -D${v}=... is required")
  endif()
endforeach()
set(prefix ${WORK_DIR}/prefix)
set(build ${WORK_DIR}/build)

# run(<what> <command...>): runs a command, fails with its output; sets `out`.
function(run what)
  message(STATUS "${what}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE o ERROR_VARIABLE o)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (exit ${rc}):\n${o}")
  endif()
  set(out "${o}" PARENT_SCOPE)
endfunction()

# 1. Install into a fresh prefix.
file(REMOVE_RECURSE ${prefix})
run("install fusebox into ${prefix}" ${CMAKE_COMMAND} --install ${FUSEBOX_BUILD_DIR} --prefix ${prefix})
foreach(f
    lib/cmake/Fusebox/FuseboxConfig.cmake
    lib/cmake/Fusebox/FuseboxConfigVersion.cmake
    lib/cmake/Fusebox/FuseboxTargets.cmake
    lib/cmake/Fusebox/FuseboxPlugin.cmake
    include/fusebox/sdk.h
    include/fusebox/core/plugin_registry.h
    include/fusebox/testing/conformance.h
    lib/fusebox/plugins/sgd.so)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "the install tree lacks ${f}")
  endif()
endforeach()
file(GLOB core_libs ${prefix}/lib/libfusebox_core.so*)
if(NOT core_libs)
  message(FATAL_ERROR "the install tree lacks lib/libfusebox_core.so")
endif()

# 2. Configure and build the example against the prefix only.
set(configure_args -S ${EXAMPLE_SOURCE_DIR} -B ${build} -G ${GENERATOR}
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix} -UFusebox_DIR)
if(CXX_COMPILER)
  list(APPEND configure_args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()
if(COMPILER_LAUNCHER)
  list(APPEND configure_args -DCMAKE_CXX_COMPILER_LAUNCHER=${COMPILER_LAUNCHER})
endif()
if(TORCH_DIR)
  list(APPEND configure_args -DTorch_DIR=${TORCH_DIR})
endif()
run("configure the example" ${CMAKE_COMMAND} ${configure_args})
file(STRINGS ${build}/CMakeCache.txt fusebox_dir REGEX "^Fusebox_DIR:")
if(NOT fusebox_dir STREQUAL "Fusebox_DIR:PATH=${prefix}/lib/cmake/Fusebox")
  message(FATAL_ERROR "the example found fusebox elsewhere: ${fusebox_dir}")
endif()
if(NOT out MATCHES "fusebox plugins: ${prefix}/lib/fusebox/plugins\n")
  message(FATAL_ERROR "the package did not name the installed plugins' folder:\n${out}")
endif()
run("build the example" ${CMAKE_COMMAND} --build ${build})
if(NOT EXISTS ${build}/momentum.so OR NOT EXISTS ${build}/momentum_conformance)
  message(FATAL_ERROR "the example build made no momentum.so or momentum_conformance")
endif()

# 3. The example's conformance test: everything passes, nothing is skipped.
run("run the example's conformance test" ${build}/momentum_conformance)
if(NOT out MATCHES "\\[       OK \\] Plugin/Momentum\\.FusedEqualsNormal/momentum" OR
   NOT out MATCHES "\\[  PASSED  \\] [0-9]+ tests" OR out MATCHES "SKIPPED")
  message(FATAL_ERROR "the conformance test did not run and pass every check:\n${out}")
endif()

# 4. Train with it through the installed trainer, in the fused backward pass.
if(NOT WITH_TRAINER)
  message(STATUS "the trainer is not built (FUSEBOX_BUILD_TRAINER=OFF): training step skipped")
  return()
endif()
set(trainer ${prefix}/bin/trainer)
if(NOT EXISTS ${trainer})
  message(FATAL_ERROR "the install tree lacks bin/trainer")
endif()
find_program(LDD ldd)
if(LDD)
  run("libraries of the installed trainer" ${LDD} ${trainer})
  string(REGEX MATCH "libfusebox_core\\.so[^\n]*" core_line "${out}")
  string(FIND "${core_line}" "=> ${prefix}/" in_prefix)
  if(in_prefix EQUAL -1)
    message(FATAL_ERROR "the installed trainer does not use the installed libfusebox_core: "
                        "'${core_line}'")
  endif()
endif()
run("list the installed plugins" ${trainer} --list-plugins)
if(NOT out MATCHES "(^|\n)sgd +[0-9]")
  message(FATAL_ERROR "the installed trainer does not find the installed plugins:\n${out}")
endif()
run("describe the example plugin" ${trainer} --plugin-dir ${build} --describe-plugin momentum)
if(NOT out MATCHES "momentum" OR NOT out MATCHES "supports_step_param")
  message(FATAL_ERROR "--describe-plugin momentum does not describe it:\n${out}")
endif()
file(REMOVE_RECURSE ${WORK_DIR}/run)
run("train with the example plugin"
  ${trainer} --optimizer-plugin ${build}/momentum.so --optimizer-args lr=0.05 momentum=0.8
  --fused-backward-pass --max-train-steps 3 --model mlp --output-dir ${WORK_DIR}/run)
message(STATUS "trainer output:\n${out}")
file(READ ${WORK_DIR}/run/summary.json summary)
if(NOT summary MATCHES "\"mode\": *\"fused\"" OR NOT summary MATCHES "\"optimizer\": *\"momentum\""
   OR NOT summary MATCHES "\"steps\": *3[,}]")
  message(FATAL_ERROR "the run was not 3 fused steps with momentum: ${summary}")
endif()
