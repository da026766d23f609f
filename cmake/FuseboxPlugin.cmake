# fusebox_add_plugin(NAME SOURCES ... [OUTPUT_DIRECTORY dir])
# Makes an optimizer plugin: a MODULE library named NAME.so (no "lib" prefix), hidden visibility
# for the plugin's own code (the entry point and the SDK's type information are exported), no
# undefined symbols left for load time, -O2 when no build type is set, and no write permission
# for group or others (which the loader refuses).
function(fusebox_add_plugin name)
  cmake_parse_arguments(ARG "" "OUTPUT_DIRECTORY" "SOURCES" ${ARGN})
  add_library(${name} MODULE ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE Fusebox::sdk)
  set_target_properties(${name} PROPERTIES
    PREFIX ""
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  # Sanitizer runtimes live in the executable, so a sanitized plugin has undefined symbols.
  if(NOT FUSEBOX_SANITIZE)
    target_link_options(${name} PRIVATE -Wl,--no-undefined)
  endif()
  target_compile_options(${name} PRIVATE -Wall -Wextra)
  # Optimizer updates are hot code: a project that set no build type still gets an optimized
  # plugin.
  if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
    target_compile_options(${name} PRIVATE -O2)
  endif()
  # The loader refuses a plugin that group or others could replace; under a umask of 002 every
  # build would make one.
  add_custom_command(TARGET ${name} POST_BUILD
    COMMAND chmod go-w $<TARGET_FILE:${name}> $<TARGET_FILE_DIR:${name}>
    VERBATIM)
  if(ARG_OUTPUT_DIRECTORY)
    set_target_properties(${name} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${ARG_OUTPUT_DIRECTORY})
  elseif(DEFINED FUSEBOX_PLUGIN_OUTPUT_DIR)
    set_target_properties(${name} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${FUSEBOX_PLUGIN_OUTPUT_DIR})
  endif()
endfunction()
