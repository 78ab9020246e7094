# CTest script: samples/snake (a layer with its own CPU and CUDA kernels) built out of
# tree against the installed SDK; the installed `loom plugins test` passes it; in a
# training run exec/partial_graph captures and replays it (its CPU kernels are host
# tasks) and trains bit for bit as eager does; its validate hook refuses bf16 before
# the run. Fails on any step.
file(REMOVE_RECURSE ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}${err}" PARENT_SCOPE)
endfunction()
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/samples/snake -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
set(loom ${WORK_DIR}/prefix/bin/loom)
# The sample's own CTest test: loom_add_layer_test(snake), `loom plugins test` on it.
run(${CMAKE_CTEST_COMMAND} --test-dir ${WORK_DIR}/build --output-on-failure)
if(NOT last_output MATCHES "snake.layer_harness .* Passed")
  message(FATAL_ERROR "the sample's layer harness test did not run:\n${last_output}")
endif()
run(${loom} plugins test ${WORK_DIR}/build/loom_layer_snake.so --tp 4)
if(NOT last_output MATCHES "6 of 6 checks pass")
  message(FATAL_ERROR "loom plugins test --tp 4 on the sample:\n${last_output}")
endif()

# The quickstart with a Snake layer in every block, eager and with partial graphs.
set(ENV{LOOM_PLUGIN_PATH} ${WORK_DIR}/build)
set(common ${SOURCE_DIR}/configs/quickstart.toml --set run.steps=20 --set run.eval_every=0
    "--set=model.block=[\"attention\", \"mlp\", \"snake\"]")
foreach(mode eager partial_graph)
  run(${loom} run ${common} --set exec.mode=${mode} --metrics ${WORK_DIR}/${mode}.jsonl)
  set(${mode}_output "${last_output}")
  file(STRINGS ${WORK_DIR}/${mode}.jsonl lines)
  list(GET lines -1 last)
  string(REGEX MATCH "\"loss\":[^,]*" ${mode}_loss "${last}")
endforeach()
# 4 blocks x 3 capturable layers x 4 microbatches per rank, forward and backward.
if(NOT partial_graph_output MATCHES "exec partial_graph \\(rank 0\\): 96 graphs captured")
  message(FATAL_ERROR "partial_graph did not capture every layer step of the model:\n${partial_graph_output}")
endif()
if(eager_loss STREQUAL "" OR NOT eager_loss STREQUAL partial_graph_loss)
  message(FATAL_ERROR "the last loss with partial graphs (${partial_graph_loss}) differs from eager's (${eager_loss})")
endif()

# Refused before any rank starts, by the plugin's validate hook.
execute_process(COMMAND ${loom} validate ${common} --set device.param_dtype=bf16
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "layer/snake computes in fp32 only")
  message(FATAL_ERROR "loom validate with bf16: exit ${rc}, no refusal from layer/snake:\n${out}\n${err}")
endif()
message(STATUS "samples/snake: built out of tree, tested, captured and replayed; last loss ${eager_loss}")
