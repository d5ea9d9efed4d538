// The few-row AVX2 / scalar kernel (quant_x8_dot.h) for GGUF's legacy types.
#include "quant_x8_dot.h"

namespace TM_QUANT_NS {

template bool group_dot_rows_qt<Q4_0>(const uint8_t*, int64_t, const ActRow*, int, bool, float[][8],
                                      StreamPrefetch*);
template bool group_dot_rows_qt<Q4_1>(const uint8_t*, int64_t, const ActRow*, int, bool, float[][8],
                                      StreamPrefetch*);
template bool group_dot_rows_qt<Q5_0>(const uint8_t*, int64_t, const ActRow*, int, bool, float[][8],
                                      StreamPrefetch*);
template bool group_dot_rows_qt<Q5_1>(const uint8_t*, int64_t, const ActRow*, int, bool, float[][8],
                                      StreamPrefetch*);

}  // namespace TM_QUANT_NS
