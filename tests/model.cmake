# LibTorch-heavy: one executable for model and trainer tests (compiles ~20 s).
strata_test(model_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/model_test.cc LIBS strata_engine)
# The layer's explicit forward/backward (ATen only, no torch/torch.h).
strata_test(layer_ops_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/layer_ops_test.cc LIBS strata_model)
