# fusebox_add_plugin(NAME SOURCES ... [OUTPUT_DIRECTORY dir])
# Makes an optimizer plugin: a MODULE library named NAME.so (no "lib" prefix), hidden visibility
# so only the entry point is exported, and no undefined symbols left for load time.
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
  if(ARG_OUTPUT_DIRECTORY)
    set_target_properties(${name} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${ARG_OUTPUT_DIRECTORY})
  elseif(DEFINED FUSEBOX_PLUGIN_OUTPUT_DIR)
    set_target_properties(${name} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${FUSEBOX_PLUGIN_OUTPUT_DIR})
  endif()
endfunction()
