# Checkpoints: the format, save and load in one process (checkpoint_test);
# process kills, ranks, resharding and the CLI (checkpoint_cli_test, one
# multi-process test at a time).
strata_test(checkpoint_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint_test.cc LIBS strata_engine)
strata_test(checkpoint_cli_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint_cli_test.cc
            LIBS nlohmann_json::nlohmann_json LOCK ranks)
add_dependencies(checkpoint_cli_test strata)
# Hugging Face export against transformers (the .venv's, installed by tools/setup.sh).
strata_test(hf_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/hf_test.cc LIBS strata_engine)
add_dependencies(hf_test strata)
