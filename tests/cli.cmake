# Runs build/strata as a subprocess.
strata_test(cli_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/cli_test.cc LIBS nlohmann_json::nlohmann_json strata_memory)
add_dependencies(cli_test strata)
