#ifndef PREFETCHD_RESAMPLE_H
#define PREFETCHD_RESAMPLE_H

#include <stdint.h>

/* Resize height x width x 3 uint8 pixels at src to out_height x out_width x 3 at dst, as
   torch's antialiased bilinear uint8 kernel does (_resample.c), columns mirrored if
   mirror; with AVX2 where vectors is set and the CPU has it (the same bytes).  0, or -1
   when out of memory. */
int resample_rgb8(const uint8_t *src, int height, int width, uint8_t *dst, int out_height, int out_width,
                  int mirror, int vectors);

#endif
