// The few-row AVX2 / scalar kernel (quant_x8_dot.h) for GGUF's K-quant types.
#include "quant_x8_dot.h"

namespace TM_QUANT_NS {

template bool group_dot_rows_qt<Q4_K>(const uint8_t*, int64_t, const ActRow*, int, bool, float[][8],
                                      StreamPrefetch*);
template bool group_dot_rows_qt<Q5_K>(const uint8_t*, int64_t, const ActRow*, int, bool, float[][8],
                                      StreamPrefetch*);
template bool group_dot_rows_qt<Q6_K>(const uint8_t*, int64_t, const ActRow*, int, bool, float[][8],
                                      StreamPrefetch*);

}  // namespace TM_QUANT_NS
