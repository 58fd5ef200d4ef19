# Optional components, found automatically and reported at configure time.
#   CUTLASS headers: MK_CUTLASS_DIR (cmake or env), else pip's nvidia-cutlass package.
#   libfabric:       pkg-config, or MK_LIBFABRIC_INCLUDE_DIR / MK_LIBFABRIC_LIBRARY (env too).
#   MPI:             find_package(MPI), or MK_MPI_INCLUDE_DIR / MK_MPI_LIBRARY (env too).
#   GoogleTest:      find_package(GTest), else sources in MK_GTEST_SOURCE_DIR or /usr/src/googletest.
set(THREADS_PREFER_PTHREAD_FLAG ON)
find_package(Threads REQUIRED)

function(mk_env_default var)
  if(NOT ${var} AND DEFINED ENV{${var}})
    set(${var} "$ENV{${var}}" PARENT_SCOPE)
  endif()
endfunction()

# ---- CUTLASS (headers only) ----
# MK_WITH_CUTLASS=OFF leaves the GEMM and attention kernels out (they report kNotSupported):
# the sanitizer builds of the CPU tests use it to skip the long CUDA compiles.
option(MK_WITH_CUTLASS "Build the CUTLASS-based GEMM and attention kernels when the headers are found" ON)
mk_env_default(MK_CUTLASS_DIR)
if(NOT MK_WITH_CUTLASS)
  set(MK_CUTLASS_DIR "")
elseif(NOT MK_CUTLASS_DIR)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c "import os, cutlass_library; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
      OUTPUT_VARIABLE _mk_cutlass OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _mk_rc)
    if(_mk_rc EQUAL 0)
      set(MK_CUTLASS_DIR "${_mk_cutlass}")
    endif()
  endif()
endif()
# `pip install .` without the kernels would install a package whose every call fails.
if(SKBUILD AND NOT (MK_CUTLASS_DIR AND EXISTS "${MK_CUTLASS_DIR}/cute/tensor.hpp"))
  message(FATAL_ERROR "mkernel: pip install needs the CUTLASS 4.2 headers: set MK_CUTLASS_DIR to their include "
                      "folder, or let the build requirement nvidia-cutlass provide them (found: '${MK_CUTLASS_DIR}')")
endif()
if(MK_CUTLASS_DIR AND EXISTS "${MK_CUTLASS_DIR}/cute/tensor.hpp")
  set(MK_HAVE_CUTLASS ON)
  add_library(mk_cutlass INTERFACE)
  add_library(mk::cutlass ALIAS mk_cutlass)
  target_include_directories(mk_cutlass SYSTEM INTERFACE "${MK_CUTLASS_DIR}")
  mk_env_default(MK_CUTLASS_UTIL_DIR)
  if(NOT MK_CUTLASS_UTIL_DIR AND EXISTS "${MK_CUTLASS_DIR}/../tools/util/include")
    set(MK_CUTLASS_UTIL_DIR "${MK_CUTLASS_DIR}/../tools/util/include")
  endif()
  if(MK_CUTLASS_UTIL_DIR)
    target_include_directories(mk_cutlass SYSTEM INTERFACE "${MK_CUTLASS_UTIL_DIR}")
  endif()
  message(STATUS "mkernel: CUTLASS headers: ${MK_CUTLASS_DIR}")
elseif(NOT MK_WITH_CUTLASS)
  set(MK_HAVE_CUTLASS OFF)
  message(STATUS "mkernel: CUTLASS headers: off (MK_WITH_CUTLASS=OFF)")
else()
  set(MK_HAVE_CUTLASS OFF)
  message(STATUS "mkernel: CUTLASS headers: not found (scripts/setup.sh installs nvidia-cutlass==4.2.0.0)")
endif()

# ---- libfabric ----
mk_env_default(MK_LIBFABRIC_INCLUDE_DIR)
mk_env_default(MK_LIBFABRIC_LIBRARY)
find_package(PkgConfig QUIET)
if(NOT MK_LIBFABRIC_INCLUDE_DIR AND PkgConfig_FOUND)
  pkg_check_modules(PC_FABRIC QUIET libfabric)
endif()
find_path(MK_LIBFABRIC_INCLUDE_DIR rdma/fabric.h HINTS ${PC_FABRIC_INCLUDE_DIRS})
find_library(MK_LIBFABRIC_LIBRARY fabric HINTS ${PC_FABRIC_LIBRARY_DIRS})
if(MK_LIBFABRIC_INCLUDE_DIR AND MK_LIBFABRIC_LIBRARY)
  set(MK_HAVE_LIBFABRIC ON)
  add_library(mk::libfabric UNKNOWN IMPORTED)
  set_target_properties(mk::libfabric PROPERTIES
    IMPORTED_LOCATION "${MK_LIBFABRIC_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${MK_LIBFABRIC_INCLUDE_DIR}")
  message(STATUS "mkernel: libfabric: ${MK_LIBFABRIC_LIBRARY}")
else()
  set(MK_HAVE_LIBFABRIC OFF)
  message(STATUS "mkernel: libfabric: not found")
endif()

# ---- MPI ----
mk_env_default(MK_MPI_INCLUDE_DIR)
mk_env_default(MK_MPI_LIBRARY)
find_package(MPI QUIET COMPONENTS C)
if(MPI_C_FOUND)
  set(MK_HAVE_MPI ON)
  add_library(mk::mpi INTERFACE IMPORTED)
  target_link_libraries(mk::mpi INTERFACE MPI::MPI_C)
  # mkernel uses MPI's C API only: keep the deprecated C++ bindings out of C++ units.
  target_compile_definitions(mk::mpi INTERFACE OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)
  message(STATUS "mkernel: MPI: ${MPI_C_LIBRARIES}")
elseif(MK_MPI_INCLUDE_DIR AND MK_MPI_LIBRARY)
  set(MK_HAVE_MPI ON)
  add_library(mk::mpi UNKNOWN IMPORTED)
  set_target_properties(mk::mpi PROPERTIES
    IMPORTED_LOCATION "${MK_MPI_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${MK_MPI_INCLUDE_DIR}"
    INTERFACE_COMPILE_DEFINITIONS "OMPI_SKIP_MPICXX=1;MPICH_SKIP_MPICXX=1")
  message(STATUS "mkernel: MPI: ${MK_MPI_LIBRARY} (headers ${MK_MPI_INCLUDE_DIR})")
else()
  set(MK_HAVE_MPI OFF)
  message(STATUS "mkernel: MPI: not found (bootstrap: threads and store only)")
endif()
find_program(MK_MPIEXEC NAMES mpirun mpiexec)
if(MK_HAVE_MPI AND NOT MK_MPIEXEC)
  message(STATUS "mkernel: no mpirun: tests labelled mpi are not registered")
endif()

# ---- GoogleTest ----
find_package(GTest QUIET)
if(NOT GTest_FOUND)
  mk_env_default(MK_GTEST_SOURCE_DIR)
  if(NOT MK_GTEST_SOURCE_DIR AND EXISTS /usr/src/googletest/CMakeLists.txt)
    set(MK_GTEST_SOURCE_DIR /usr/src/googletest)
  endif()
  if(MK_GTEST_SOURCE_DIR)
    set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
    set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
    add_subdirectory(${MK_GTEST_SOURCE_DIR} ${CMAKE_BINARY_DIR}/_googletest EXCLUDE_FROM_ALL)
    add_library(GTest::gtest ALIAS gtest)
    set(GTest_FOUND ON)
    message(STATUS "mkernel: GoogleTest: built from ${MK_GTEST_SOURCE_DIR}")
  endif()
else()
  message(STATUS "mkernel: GoogleTest: found")
endif()

# ---- NCCL (cuBLAS + NCCL baselines) ----
include(${CMAKE_CURRENT_LIST_DIR}/FindMkNccl.cmake)
