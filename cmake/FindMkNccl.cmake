# NCCL, for the cuBLAS + NCCL baselines (target mkernel_baseline). Included from MkDeps.cmake.
# Sets MK_HAVE_NCCL and, when found, the imported target mk::nccl. Looked for, first hit wins
# (header and library from the same place):
#   MK_NCCL_INCLUDE_DIR + MK_NCCL_LIBRARY (cmake or env), both given;
#   MK_NCCL_DIR (cmake or env): <dir>/include and <dir>/lib, lib64;
#   the CUDA toolkit (its include and library dirs, and the toolkit root's include, lib, lib64);
#   /usr/local, /usr;
#   pip's nvidia-nccl-cu* package (python3 -c "import nvidia.nccl"), whose lib may hold only
#   libnccl.so.2 (no unversioned link): that is accepted.
mk_env_default(MK_NCCL_DIR)
mk_env_default(MK_NCCL_INCLUDE_DIR)
mk_env_default(MK_NCCL_LIBRARY)

# Sets out_var to the NCCL library file in the given dirs (libnccl.so, else libnccl.so.2), or "".
function(mk_nccl_library_in out_var)
  foreach(dir ${ARGN})
    foreach(name libnccl.so libnccl.so.2)
      if(EXISTS "${dir}/${name}")
        set(${out_var} "${dir}/${name}" PARENT_SCOPE)
        return()
      endif()
    endforeach()
  endforeach()
  set(${out_var} "" PARENT_SCOPE)
endfunction()

set(_mk_nccl_inc "")
set(_mk_nccl_lib "")
if(MK_NCCL_INCLUDE_DIR AND MK_NCCL_LIBRARY)
  set(_mk_nccl_inc "${MK_NCCL_INCLUDE_DIR}")
  set(_mk_nccl_lib "${MK_NCCL_LIBRARY}")
else()
  # Candidates in order, each "include_dir|lib_dir|lib_dir...".
  set(_mk_nccl_candidates "")
  macro(mk_nccl_add_root root)
    list(APPEND _mk_nccl_candidates "${root}/include|${root}/lib|${root}/lib64|${root}/lib/x86_64-linux-gnu")
  endmacro()
  if(MK_NCCL_DIR)
    mk_nccl_add_root("${MK_NCCL_DIR}")
  endif()
  foreach(inc ${CUDAToolkit_INCLUDE_DIRS})
    list(APPEND _mk_nccl_candidates "${inc}|${CUDAToolkit_LIBRARY_DIR}")
  endforeach()
  foreach(dir ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_BIN_DIR})
    get_filename_component(_mk_cuda_root "${dir}" DIRECTORY)
    mk_nccl_add_root("${_mk_cuda_root}")
  endforeach()
  mk_nccl_add_root(/usr/local)
  mk_nccl_add_root(/usr)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    # nvidia.nccl may be a namespace package (no __file__): take its first path.
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
      OUTPUT_VARIABLE _mk_nccl_py OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _mk_rc)
    if(_mk_rc EQUAL 0 AND _mk_nccl_py)
      mk_nccl_add_root("${_mk_nccl_py}")
    endif()
  endif()
  foreach(cand ${_mk_nccl_candidates})
    string(REPLACE "|" ";" _mk_parts "${cand}")
    list(POP_FRONT _mk_parts _mk_inc)
    if(EXISTS "${_mk_inc}/nccl.h")
      mk_nccl_library_in(_mk_lib ${_mk_parts})
      if(_mk_lib)
        set(_mk_nccl_inc "${_mk_inc}")
        set(_mk_nccl_lib "${_mk_lib}")
        break()
      endif()
    endif()
  endforeach()
endif()

if(_mk_nccl_inc AND _mk_nccl_lib AND EXISTS "${_mk_nccl_inc}/nccl.h" AND EXISTS "${_mk_nccl_lib}")
  set(MK_HAVE_NCCL ON)
  file(STRINGS "${_mk_nccl_inc}/nccl.h" _mk_nccl_ver REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*NCCL_MINOR ([0-9]+).*NCCL_PATCH ([0-9]+).*" "\\1.\\2.\\3"
         MK_NCCL_VERSION "${_mk_nccl_ver}")
  add_library(mk::nccl SHARED IMPORTED)
  set_target_properties(mk::nccl PROPERTIES
    IMPORTED_LOCATION "${_mk_nccl_lib}"
    INTERFACE_INCLUDE_DIRECTORIES "${_mk_nccl_inc}")
  message(STATUS "mkernel: NCCL ${MK_NCCL_VERSION}: ${_mk_nccl_lib} (headers ${_mk_nccl_inc})")
else()
  set(MK_HAVE_NCCL OFF)
  message(STATUS "mkernel: NCCL: not found (no cuBLAS + NCCL baselines; set MK_NCCL_DIR)")
endif()
