# Multi-process tests: rank_worker is one rank of a test run (started by
# strata launch); ranks_test drives it, strata and torchrun. One such test at a
# time: they start several processes on a 2-core machine.
add_executable(rank_worker ${CMAKE_CURRENT_SOURCE_DIR}/rank_worker.cc)
target_link_libraries(rank_worker PRIVATE strata_engine nlohmann_json::nlohmann_json strata_warnings)
strata_test(ranks_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/ranks_test.cc LIBS nlohmann_json::nlohmann_json
            LOCK ranks)
add_dependencies(ranks_test strata rank_worker)
strata_test(comm_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/comm_test.cc LIBS strata_comm strata_config strata_memory)
