# CTest script: install loom into a scratch prefix, build samples/learned_scale
# against it with find_package(LoomSDK), then load the result with the installed
# `loom plugins check` and run its layer harness test. Fails on any step.
file(REMOVE_RECURSE ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
# The SDK's headers: the ABI (loom_abi.h and the service headers it includes) and the C++ layer.
foreach(header loom_abi.h loom_tp.h loom_ep.h cpp/plugin.hpp cpp/tensor_parallel.hpp cpp/expert_parallel.hpp
       layers/layer_math.hpp layers/param_set.hpp layers/positions.hpp)
  if(NOT EXISTS ${WORK_DIR}/prefix/include/loom/${header})
    message(FATAL_ERROR "the installed SDK lacks include/loom/${header}")
  endif()
endforeach()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/samples/learned_scale -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/prefix/bin/loom plugins check ${WORK_DIR}/build)
if(NOT last_output MATCHES "layer/learned_scale")
  message(FATAL_ERROR "the sample plugin did not register layer/learned_scale:\n${last_output}")
endif()
# Its CTest test (loom_add_layer_test): the installed `loom plugins test` passes it.
run(${CMAKE_CTEST_COMMAND} --test-dir ${WORK_DIR}/build --output-on-failure)
if(NOT last_output MATCHES "learned_scale.layer_harness .* Passed")
  message(FATAL_ERROR "the sample's layer harness test did not pass:\n${last_output}")
endif()
# The installed loom finds its own plugins without any environment.
run(${WORK_DIR}/prefix/bin/loom plugins list)
if(NOT last_output MATCHES "device/cpu")
  message(FATAL_ERROR "installed loom does not find its plugins:\n${last_output}")
endif()
# Without DLPack, find_package(LoomSDK) fails and says what is missing (DLPack's package
# disabled and /usr ignored, so neither it nor the header is found).
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/samples/learned_scale -B ${WORK_DIR}/build_nodlpack
                        -G ${GENERATOR} -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_DISABLE_FIND_PACKAGE_dlpack=TRUE
                        -DCMAKE_IGNORE_PREFIX_PATH=/usr -DCMAKE_IGNORE_PATH=/usr/include
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "LoomSDK needs DLPack")
  message(FATAL_ERROR "find_package(LoomSDK) without DLPack: exit ${rc}, no message naming DLPack:\n${out}\n${err}")
endif()
message(STATUS "out-of-tree plugin built and loaded")
