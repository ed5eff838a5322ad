# Benchmark tools' own logic that needs no benchmark: the DeepSpeed side-by-side's config translation
# (tools/ds_translate.py) against transformers and `strata plan`, and its token order.
set(STRATA_TOOLS_PYTHON ${PROJECT_SOURCE_DIR}/.venv/bin/python)
if(NOT EXISTS ${STRATA_TOOLS_PYTHON})
  set(STRATA_TOOLS_PYTHON python3)
endif()
add_test(NAME DsTranslateTest
         COMMAND ${STRATA_TOOLS_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ds_translate_test.py $<TARGET_FILE:strata>)
set_tests_properties(DsTranslateTest PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 ENVIRONMENT "OMP_NUM_THREADS=1;STRATA_RATES_CACHE=off")
# The module layering of docs/design.md: includes point down the layers, no include or import circle.
add_test(NAME LayersTest COMMAND ${STRATA_TOOLS_PYTHON} ${PROJECT_SOURCE_DIR}/tools/check_layers.py ${PROJECT_SOURCE_DIR})
set_tests_properties(LayersTest PROPERTIES TIMEOUT 60)
# tools/tokenize.py on fine-tuning examples: chat templates per family against transformers' apply_chat_template,
# prompt + completion, loss masks, the index, bad rows (docs/token-format.md, "Examples and loss masks").
add_test(NAME TokenizeExamplesTest COMMAND ${STRATA_TOOLS_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/tokenize_examples_test.py)
set_tests_properties(TokenizeExamplesTest PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 ENVIRONMENT "OMP_NUM_THREADS=1")
# tools/trace_summary.py (where a step's time goes, from `strata train --trace`) on a trace made by the test.
add_test(NAME TraceSummaryTest COMMAND ${STRATA_TOOLS_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/trace_summary_test.py)
set_tests_properties(TraceSummaryTest PROPERTIES TIMEOUT 60)
