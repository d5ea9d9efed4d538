// group_dot_rows (quant_act.h): the AVX2 / scalar few-row kernel of quant_x8_dot.h, by weight type;
// each type's instances are compiled in quant_gemm_x8_{legacy,k,own}.cpp, in parallel.
#include "quant_act.h"

namespace TM_QUANT_NS {

bool group_dot_rows(int qtype, const uint8_t* group, int64_t K, const ActRow* a, int mr, bool fine, float out[][8],
                    StreamPrefetch* pf) {
  return dispatch_qtype(qtype, [&](auto qt) {
    group_dot_rows_qt<decltype(qt)::value>(group, K, a, mr, fine, out, pf);
  });
}

}  // namespace TM_QUANT_NS
