# Install rules and the CMake package.
#
# `cmake --install <build> --prefix <p>` lays out the same tree as the build folder, so the trainer
# finds its plugins at <bin>/../lib/fusebox/plugins in both:
#   <p>/bin/trainer
#   <p>/lib/libfusebox_core.so*
#   <p>/lib/fusebox/plugins/<name>.so
#   <p>/include/fusebox/...                 (SDK, core and conformance-kit headers)
#   <p>/lib/cmake/Fusebox/                  (FuseboxConfig.cmake and friends)
#
# A plugin project then needs only:
#   find_package(Fusebox CONFIG REQUIRED)   # Fusebox::sdk, Fusebox::core, Fusebox::conformance
#   fusebox_add_plugin(my_opt SOURCES my_opt.cpp)
include(CMakePackageConfigHelpers)

set(FUSEBOX_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/Fusebox CACHE STRING
  "Where the Fusebox CMake package is installed, relative to the prefix")

# Exported names: Fusebox::sdk and Fusebox::core, as in the build tree.
set_target_properties(fusebox_sdk PROPERTIES EXPORT_NAME sdk)
# libfusebox_core finds LibTorch through the link path if that is not a system folder.
set_target_properties(fusebox_core PROPERTIES EXPORT_NAME core INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS fusebox_sdk fusebox_core
  EXPORT FuseboxTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/sdk/include/ ${PROJECT_SOURCE_DIR}/core/include/
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")
install(EXPORT FuseboxTargets
  NAMESPACE Fusebox::
  FILE FuseboxTargets.cmake
  DESTINATION ${FUSEBOX_INSTALL_CMAKEDIR})

# The conformance kit needs GoogleTest; its own export set is loaded only where GTest is found.
if(TARGET fusebox_conformance)
  set_target_properties(fusebox_conformance PROPERTIES EXPORT_NAME conformance)
  install(TARGETS fusebox_conformance EXPORT FuseboxConformanceTargets)
  install(EXPORT FuseboxConformanceTargets
    NAMESPACE Fusebox::
    FILE FuseboxConformanceTargets.cmake
    DESTINATION ${FUSEBOX_INSTALL_CMAKEDIR})
endif()

# Plugins: they link LibTorch only (never libfusebox_core), so they need no $ORIGIN entry.
foreach(plugin IN LISTS FUSEBOX_PLUGINS)
  if(TARGET ${plugin})
    set_target_properties(${plugin} PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
    install(TARGETS ${plugin} LIBRARY DESTINATION ${FUSEBOX_PLUGIN_SUBDIR})
  endif()
endforeach()

# The trainer (when built): bin/, finding libfusebox_core in ../lib.
if(TARGET trainer)
  get_target_property(_fusebox_trainer_rpath trainer INSTALL_RPATH)
  if(NOT _fusebox_trainer_rpath)
    set_target_properties(trainer PROPERTIES INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")
  endif()
  set_target_properties(trainer PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
  install(TARGETS trainer RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

# The package: config (with the LibTorch it was built against), version, plugin helper.
string(REGEX MATCH "^[0-9]+\\.[0-9]+" FUSEBOX_TORCH_MAJOR_MINOR "${Torch_VERSION}")
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/FuseboxConfig.cmake.in
  ${PROJECT_BINARY_DIR}/FuseboxConfig.cmake
  INSTALL_DESTINATION ${FUSEBOX_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/FuseboxConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMajorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/FuseboxConfig.cmake
  ${PROJECT_BINARY_DIR}/FuseboxConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/FuseboxPlugin.cmake
  DESTINATION ${FUSEBOX_INSTALL_CMAKEDIR})
