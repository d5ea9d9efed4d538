// The few-row AVX2 / scalar kernel (quant_x8_dot.h) for Q8_0 and tokenmill's own int8 / int4 formats (--quantization).
#include "quant_x8_dot.h"

namespace TM_QUANT_NS {

template bool group_dot_rows_qt<Q8_0>(const uint8_t*, int64_t, const ActRow*, int, bool, float[][8],
                                      StreamPrefetch*);
template bool group_dot_rows_qt<I8_ROW>(const uint8_t*, int64_t, const ActRow*, int, bool, float[][8],
                                      StreamPrefetch*);
template bool group_dot_rows_qt<I4_G128>(const uint8_t*, int64_t, const ActRow*, int, bool, float[][8],
                                      StreamPrefetch*);

}  // namespace TM_QUANT_NS
