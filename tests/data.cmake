strata_test(data_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/data_test.cc LIBS strata_data)
# Runs tools/tokenize.py (and build/strata for the sidecar check).
if(NOT STRATA_LEAF_ONLY)
  strata_test(tokenize_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/tokenize_test.cc LIBS strata_config)
  add_dependencies(tokenize_test strata)
endif()
# Fine-tuning data through `strata train`: masked examples across placements, schedules, ranks, resume.
if(NOT STRATA_LEAF_ONLY)
  strata_test(finetune_data_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/finetune_data_test.cc
              LIBS nlohmann_json::nlohmann_json LOCK ranks)
  add_dependencies(finetune_data_test strata)
endif()
