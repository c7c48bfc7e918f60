/* Generated from kernels/modes.py (python -m rana.kernels.modes): edit the table there. */
#ifndef RANA_MODES_H
#define RANA_MODES_H
#define RANA_MODE_NONE 0
#define RANA_MODE_SQUARE 1
#define RANA_MODE_ABS_SCALED 2
#define RANA_MODE_ABS 3
#endif
