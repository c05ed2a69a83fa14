// Dense and FP8 weights through the GEMV skeleton of include/gemv.h (the kernel template and its contract),
// in the formats of include/gemv_formats.h; linear.py instantiates gemv<gemv_vec<E>, XT> and
// gemv<gemv_elem<E>, XT> for every weight and activation type.

#include "gemv_formats.h"
