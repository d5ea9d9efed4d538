// The few-row AVX2 / scalar kernel (quant_x8_dot.h) for GGUF's legacy types.
#include "quant_x8_dot.h"

TM_X8_INSTANCES(Q4_0)
TM_X8_INSTANCES(Q4_1)
TM_X8_INSTANCES(Q5_0)
TM_X8_INSTANCES(Q5_1)
