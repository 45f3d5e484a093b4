"""Settings under which two runs compute the same tokens, for tests that compare them.

float32, and one GEMM for every engine. In bfloat16 (what --dtype auto picks on an AMX CPU) a
row's rounding depends on its round's other rows, so two runs that batch the same requests
differently may flip a near-tie; and each engine's --weight-pack auto measures for itself,
while the packed and plain GEMMs round differently.
"""

F32 = {"dtype": "float32", "weight_pack": "off"}  # EngineConfig's fields
F32_ARGS = ["--dtype", "float32", "--weight-pack", "off"]  # the same for `mstrace run` and `serve`
