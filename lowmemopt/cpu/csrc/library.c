/* The kernel library: the units compiled as one translation unit, in this order (lowmemopt/cpu/build.py compiles this
 * file). One unit, as when they were one file, gives the compiler the same view across the units: it inlines the same
 * helpers into the row loops, so the code is the same (measured: every function of the avx512, avx2 and scalar builds
 * the same instructions as the single file's). A new unit goes here, after the units it uses. */
#include "runner.c"
#include "elementwise.c"
#include "codec.c"
#include "factored.c"
#include "fileio.c"
