# loom_add_plugin(<target> KIND <kind> NAME <name> SOURCES <files...> [LIBRARIES <libs...>]
#                 [OUTPUT_DIR <dir>] [NO_INSTALL])
# loom_add_layer_test(<target> [SET <option=value>...] [ARGS <arguments...>])
#
# Builds a loom plugin: a MODULE library with hidden visibility whose only exported
# symbols are the ABI entry points (version script), linked against nothing of the
# engine. The file is named loom_<kind>_<name>.so (dots in the name become '_').
include_guard(GLOBAL)
set(LOOM_PLUGIN_MAP ${CMAKE_CURRENT_LIST_DIR}/loom_plugin.map CACHE INTERNAL "")

function(loom_add_plugin target)
  cmake_parse_arguments(P "NO_INSTALL" "KIND;NAME;OUTPUT_DIR" "SOURCES;LIBRARIES" ${ARGN})
  if(NOT P_KIND OR NOT P_NAME OR NOT P_SOURCES)
    message(FATAL_ERROR "loom_add_plugin(${target}): KIND, NAME and SOURCES are required")
  endif()
  string(REPLACE "." "_" file_name "loom_${P_KIND}_${P_NAME}")
  add_library(${target} MODULE ${P_SOURCES})
  set_target_properties(${target} PROPERTIES
    PREFIX "" OUTPUT_NAME ${file_name}
    C_VISIBILITY_PRESET hidden CXX_VISIBILITY_PRESET hidden CUDA_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  if(TARGET LoomSDK::sdk)
    target_link_libraries(${target} PRIVATE LoomSDK::sdk ${P_LIBRARIES})
  else()
    target_link_libraries(${target} PRIVATE loom_sdk ${P_LIBRARIES})
  endif()
  target_link_options(${target} PRIVATE "LINKER:--version-script=${LOOM_PLUGIN_MAP}" "LINKER:--no-undefined")
  if(P_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${P_OUTPUT_DIR})
  elseif(DEFINED LOOM_PLUGIN_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${LOOM_PLUGIN_OUTPUT_DIR})
  endif()
  if(LOOM_SDK_IN_TREE)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX,C>:${LOOM_WARNINGS}>)
    if(NOT P_NO_INSTALL)
      install(TARGETS ${target} LIBRARY DESTINATION ${LOOM_PLUGIN_INSTALL_DIR})
      set_property(GLOBAL APPEND PROPERTY LOOM_PLUGIN_TARGETS ${target})
    endif()
  endif()
endfunction()

# A CTest test <target>.layer_harness running `loom plugins test` on the layer plugin
# <target> (the engine's layer harness: finite differences, gradient accumulation,
# microbatches in flight, tp 2 with and without sequence parallelism against one rank),
# with its options from SET and further `loom plugins test` arguments from ARGS
# (e.g. --tp 4, --skip gradients). Call enable_testing() first.
function(loom_add_layer_test target)
  cmake_parse_arguments(T "" "" "SET;ARGS" ${ARGN})
  if(TARGET loom)
    set(loom $<TARGET_FILE:loom>)
  elseif(DEFINED LOOM_EXECUTABLE)
    set(loom ${LOOM_EXECUTABLE})
  else()
    message(FATAL_ERROR "loom_add_layer_test(${target}): no loom executable (find_package(LoomSDK) sets LOOM_EXECUTABLE)")
  endif()
  set(sets)
  foreach(s ${T_SET})
    list(APPEND sets --set ${s})
  endforeach()
  add_test(NAME ${target}.layer_harness COMMAND ${loom} plugins test $<TARGET_FILE:${target}> ${sets} ${T_ARGS})
endfunction()
