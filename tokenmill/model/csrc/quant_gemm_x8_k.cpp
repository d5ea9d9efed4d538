// The few-row AVX2 / scalar kernel (quant_x8_dot.h) for GGUF's K-quant types.
#include "quant_x8_dot.h"

TM_X8_INSTANCES(Q4_K)
TM_X8_INSTANCES(Q5_K)
TM_X8_INSTANCES(Q6_K)
