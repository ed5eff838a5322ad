# The step's parts driven alone (src/engine/): the gradient path (homes on
# every tier, the lander, ordered norms, bytes per link) and the optimizer
# pass (pieces on every tier against CPU Adam over the whole shard space).
strata_test(step_parts_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/step_parts_test.cc LIBS strata_engine)
