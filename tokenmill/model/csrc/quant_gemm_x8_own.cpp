// The few-row AVX2 / scalar kernel (quant_x8_dot.h) for Q8_0 and tokenmill's own int8 / int4 formats (--quantization).
#include "quant_x8_dot.h"

TM_X8_INSTANCES(Q8_0)
TM_X8_INSTANCES(I8_ROW)
TM_X8_INSTANCES(I4_G128)
