# Install and export (included at the end of the top-level CMakeLists.txt, once the targets
# exist). `cmake --install <build> --prefix <prefix>` puts under <prefix>:
#   include/mkernel/...                     the public headers (the directory, less net/ and proxy/)
#   lib/libmkernel.a, lib/libmkernel_capi.so
#   bin/mkernel                             the CLI
#   lib/cmake/mkernel/                      mkernelConfig.cmake, its version file, the targets
# A consumer then writes (tests/consumer is the example CI builds):
#   find_package(mkernel CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE mkernel::mkernel)
# Exported targets: mkernel::mkernel (static), mkernel::mkernel_capi (shared, the C ABI for C and
# Python; header mkernel/c_api.h), mkernel::mkernel_cli (the `mkernel` executable). scripts/consumer_check.sh
# builds exactly these three before installing: keep its list in step.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(MK_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/mkernel" CACHE STRING
    "Where the installed mkernelConfig.cmake goes, relative to the install prefix")

# Consumers compile mkernel's headers, so they need C++17 too (the build sets it globally).
target_compile_features(mkernel INTERFACE cxx_std_17)

# INCLUDES DESTINATION adds <prefix>/include to the exported mkernel::mkernel; the build tree
# keeps its own include directory ($<BUILD_INTERFACE:...> on the target).
install(TARGETS mkernel
  EXPORT mkernelTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# The C ABI's header is include/mkernel/c_api.h (python/mkernel/_capi.py is checked against it). Installed, both
# keep the run path to the shared libraries they link outside the system's directories (cuBLAS
# and NCCL in the CUDA toolkit, MPI), as their build-tree copies have it.
set_target_properties(mkernel_capi mkernel_cli PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS mkernel_capi mkernel_cli
  EXPORT mkernelTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# The directory as a whole (no file list), less the network backend and the host proxy: their
# headers sit in include/ for the build's layering (docs/architecture.md) but no public header
# includes them and users do not call them (only the CLI's doctor does, from the build tree).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  PATTERN "net" EXCLUDE PATTERN "proxy" EXCLUDE)

install(EXPORT mkernelTargets
  NAMESPACE mkernel::
  FILE mkernelTargets.cmake
  DESTINATION ${MK_INSTALL_CMAKEDIR})

# What mkernelConfig.cmake needs to re-create the imported targets the export names:
#   CUDA::cudart_static          (PUBLIC)  find_dependency(CUDAToolkit) at this build's version;
#   mk::mpi                      (PUBLIC, with MPI)  FindMPI, or the paths MkDeps was given;
#   mk::libfabric, Threads::Threads  (PRIVATE, but a static library's private libraries are on
#                                the consumer's link line as $<LINK_ONLY:...>) found again, with
#                                this build's paths as hints; `dl` is a plain library name.
# CUTLASS is headers only and never reaches the export ($<BUILD_INTERFACE:...> in CMakeLists.txt).
set(MK_CONFIG_CUDA_VERSION "${CUDAToolkit_VERSION_MAJOR}.${CUDAToolkit_VERSION_MINOR}")
set(MK_CONFIG_MPI_VIA_FINDMPI OFF)
if(MK_HAVE_MPI AND MPI_C_FOUND)
  set(MK_CONFIG_MPI_VIA_FINDMPI ON)
endif()
set(MK_CONFIG_LIBFABRIC_LIBDIR "")
if(MK_HAVE_LIBFABRIC)
  get_filename_component(MK_CONFIG_LIBFABRIC_LIBDIR "${MK_LIBFABRIC_LIBRARY}" DIRECTORY)
endif()
foreach(flag MK_HAVE_MPI MK_HAVE_LIBFABRIC MK_HAVE_CUTLASS)
  # As ON/OFF, so the template's if() reads them the same whatever spelling the build used.
  if(${flag})
    set(MK_CONFIG_${flag} ON)
  else()
    set(MK_CONFIG_${flag} OFF)
  endif()
endforeach()

configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/mkernelConfig.cmake.in
  ${PROJECT_BINARY_DIR}/mkernelConfig.cmake
  INSTALL_DESTINATION ${MK_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so only the same major.minor is compatible.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/mkernelConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/mkernelConfig.cmake
  ${PROJECT_BINARY_DIR}/mkernelConfigVersion.cmake
  DESTINATION ${MK_INSTALL_CMAKEDIR})
