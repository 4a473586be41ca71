// Header of the syntax-only clang pass: the shim with device/constant/threadgroup
// spelled as clang address spaces, so that mixing them is a compile error.
#pragma once
#define MSL_ADDRSPACE_PASS 1
#include "msl_shim.h"
