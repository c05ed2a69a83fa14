// The first file of the Comfy Metal library (after the generated prelude of source.py): the Metal standard
// library and the helpers every file may use without including them (FP8 and bf16 bit conversions).
// Shared helpers live in include/, one header per concept; a file includes what it uses with
// `#include "name.h"` (source.py inlines each header once per library).
//
// The helpers are integer bit manipulation on purpose: torch.mps.compile_shader uses safe math by default,
// but PYTORCH_MPS_FAST_MATH=1 (and Metal's own default) turn on fast math, where isnan()/isinf() may be
// folded away and float denormals may be flushed; integer code is exact in both.
#include <metal_stdlib>
using namespace metal;

// Fully unroll the loop that follows (a constant trip count: rows, groups of 4 values), as MLX and llama.cpp
// write it: register arrays are then indexed by constants, and no loop counter is left in the code.
#define UNROLL _Pragma("clang loop unroll(full)")

#include "bf16.h"
#include "fp8.h"
