# LibTorch-heavy: one executable for model and trainer tests (compiles ~20 s).
strata_test(model_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/model_test.cc LIBS strata_engine)
# The layer's explicit forward/backward (ATen only, no torch/torch.h).
strata_test(layer_ops_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/layer_ops_test.cc LIBS strata_model)
# LoRA layers against PEFT (tests/peft_layer.py), the frozen layout, the lora section.
strata_test(lora_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/lora_test.cc LIBS strata_model strata_config)
# LoRA training over a frozen base: against PEFT + torch AdamW, across placements (tests/peft_train.py).
strata_test(lora_train_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/lora_train_test.cc LIBS strata_engine)
# Mixture-of-experts models against transformers (tests/moe_ref.py) and
# through `strata train` (placements, ranks: one multi-process test at a time).
strata_test(moe_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/moe_test.cc LIBS strata_engine LOCK ranks)
add_dependencies(moe_test strata)
