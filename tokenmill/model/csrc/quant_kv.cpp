// Quantized KV cache (int8 / fp8 e4m3 with a scale per token and head): written by kv_write_quant,
// read in place by the paged decode kernel.
#include <ATen/ATen.h>
