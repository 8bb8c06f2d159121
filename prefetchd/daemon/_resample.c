/* Antialiased bilinear resize of H x W x 3 uint8 pixels, the bytes of torch's uint8 kernel.
 *
 * Part of prefetchd.daemon._cropjpeg (the wrapper is there).  torchvision's v2 resize
 * (BILINEAR, antialias=True) of a uint8 image calls torch's _upsample_bilinear2d_aa on
 * the uint8 pixels where the CPU has AVX2 or AVX-512, or is arm64 (elsewhere torchvision
 * resizes in float32, which prefetchd does not follow: resample.py says why); torch then
 * resamples as Pillow does, in integers: per axis, the triangle
 * filter's weights in double, normalised per output sample, rounded to int16 at the
 * largest precision at which the axis's largest weight still fits; then a horizontal
 * pass into uint8 rows and a vertical pass over those, each an integer dot product plus
 * half a unit, shifted down and clamped.  This file does the same arithmetic in the same
 * order, so its bytes equal torch's (tests/daemon/test_resample.py compares them on
 * random sizes, against torch's AVX2 kernel and its generic one), and a worker that
 * decodes with the crop-aware decoder needs no torch at all: a cold start without the
 * ~1.8 s of importing it.
 *
 * The vertical pass runs over whole rows of int32 accumulators, which the compiler
 * vectorises; the horizontal pass is a short dot product per output pixel.
 */
#include "_resample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct axis {
    int taps;            /* weights per output sample: the widest the filter can need */
    int precision;       /* fractional bits of the int16 weights */
    int *first, *count;  /* [out]: first source sample, how many it reads */
    int16_t *weights;    /* [out][taps] */
    int pair_count;      /* (taps + 1) / 2 */
    int32_t *pairs;      /* [out][pair_count]: weights 2q and 2q + 1 as the int16 halves of one int32, 0 past count */
};

static void axis_free(struct axis *a) {
    free(a->first);
    free(a->count);
    free(a->weights);
    free(a->pairs);
}

static double triangle(double x) {
    x = fabs(x);
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* torch's _compute_index_ranges_int16_weights for the bilinear filter with antialias,
   align_corners=False and no scale factor: each expression in torch's order, so that
   every double, and so every rounded weight, is the same. */
static int axis_init(struct axis *a, int in, int out) {
    const double scale = (double)in / out;
    const double support = scale >= 1.0 ? scale : 1.0; /* interp_size 2, times 0.5, times the scale */
    const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
    const int taps = (int)ceil(support) * 2 + 1;
    double *real = calloc((size_t)out * taps, sizeof *real);
    a->taps = taps;
    a->first = malloc((size_t)out * sizeof *a->first);
    a->count = malloc((size_t)out * sizeof *a->count);
    a->weights = malloc((size_t)out * taps * sizeof *a->weights);
    a->pair_count = (taps + 1) / 2;
    a->pairs = malloc((size_t)out * a->pair_count * sizeof *a->pairs);
    if (real == NULL || a->first == NULL || a->count == NULL || a->weights == NULL || a->pairs == NULL) {
        free(real);
        axis_free(a);
        return -1;
    }
    double wt_max = 0.0;
    for (int i = 0; i < out; i++) {
        const double center = scale * (i + 0.5);
        int64_t xmin = (int64_t)(center - support + 0.5); /* truncates toward zero, as torch's cast */
        if (xmin < 0) xmin = 0;
        int64_t xmax = (int64_t)(center + support + 0.5);
        if (xmax > in) xmax = in;
        int64_t xsize = xmax - xmin;
        if (xsize < 0) xsize = 0;
        if (xsize > taps) xsize = taps;
        double *w = real + (size_t)i * taps, total = 0.0;
        for (int64_t j = 0; j < xsize; j++) {
            w[j] = triangle((j + xmin - center + 0.5) * invscale);
            total += w[j];
        }
        if (total != 0.0) {
            for (int64_t j = 0; j < xsize; j++) {
                w[j] /= total;
                if (w[j] > wt_max) wt_max = w[j];
            }
        }
        a->first[i] = (int)xmin;
        a->count[i] = (int)xsize;
    }
    int precision;
    for (precision = 0; precision < 22; precision++)
        if ((int)(0.5 + wt_max * (1 << (precision + 1))) >= (1 << 15)) break;
    a->precision = precision;
    for (size_t k = 0; k < (size_t)out * taps; k++) {
        const double v = real[k] * (1 << precision);
        a->weights[k] = (int16_t)(v < 0 ? (int)(-0.5 + v) : (int)(0.5 + v));
    }
    for (int i = 0; i < out; i++) {
        const int16_t *k = a->weights + (size_t)i * taps;
        for (int q = 0; q < a->pair_count; q++) {
            const uint16_t even = (uint16_t)k[2 * q], odd = 2 * q + 1 < a->count[i] ? (uint16_t)k[2 * q + 1] : 0;
            a->pairs[(size_t)i * a->pair_count + q] = (int32_t)((uint32_t)even | (uint32_t)odd << 16);
        }
    }
    free(real);
    return 0;
}

static inline uint8_t clamp8(int32_t v, int precision) {
    v >>= precision; /* arithmetic shift, as torch's and Pillow's */
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

/* rows x in_width pixels -> rows x out_width, along each row; mirrored if asked. */
static void horizontal(const uint8_t *src, int rows, int in_width, uint8_t *dst, int out_width,
                       const struct axis *a, int mirror) {
    const int32_t half = 1 << (a->precision - 1);
    for (int y = 0; y < rows; y++) {
        const uint8_t *row = src + (size_t)y * in_width * 3;
        uint8_t *out = dst + (size_t)y * out_width * 3;
        for (int x = 0; x < out_width; x++) {
            const uint8_t *p = row + (size_t)a->first[x] * 3;
            const int16_t *k = a->weights + (size_t)x * a->taps;
            int32_t r = half, g = half, b = half;
            for (int j = 0; j < a->count[x]; j++, p += 3) {
                r += p[0] * k[j];
                g += p[1] * k[j];
                b += p[2] * k[j];
            }
            uint8_t *o = out + (size_t)(mirror ? out_width - 1 - x : x) * 3;
            o[0] = clamp8(r, a->precision);
            o[1] = clamp8(g, a->precision);
            o[2] = clamp8(b, a->precision);
        }
    }
}

/* in_rows x width pixels -> out_rows x width, down each column. */
static void vertical(const uint8_t *src, int width, uint8_t *dst, int out_rows, const struct axis *a, int32_t *acc) {
    const int32_t half = 1 << (a->precision - 1);
    const size_t n = (size_t)width * 3;
    for (int y = 0; y < out_rows; y++) {
        const int16_t *k = a->weights + (size_t)y * a->taps;
        for (size_t i = 0; i < n; i++) acc[i] = half;
        for (int j = 0; j < a->count[y]; j++) {
            const uint8_t *s = src + (size_t)(a->first[y] + j) * n;
            const int32_t w = k[j];
            for (size_t i = 0; i < n; i++) acc[i] += s[i] * w;
        }
        uint8_t *out = dst + (size_t)y * n;
        for (size_t i = 0; i < n; i++) out[i] = clamp8(acc[i], a->precision);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2 1

/* The same sums with AVX2, two taps per multiply-add (pmaddwd: int16 pixel pairs times int16
   weight pairs, summed into int32), so the bytes are the scalar passes' exactly.  Four rows
   share each weight pair, one row in each 128-bit lane of two registers.  A tap pair reads 8
   bytes where it uses 6 (the pair's second pixel may lie past the row, with weight 0): up to 5
   bytes past a row, which the next row holds where rows are 2 pixels or more.  So the image's
   last rows, past which nothing may be read, and 1-pixel rows go to the scalar pass.  Output
   pixels are written in order, 4 bytes each (the 4th is the next pixel's, written after), but
   a row's last. */
__attribute__((target("avx2"))) static void horizontal_avx2(const uint8_t *src, int rows, int in_width,
                                                            uint8_t *dst, int out_width,
                                                            const struct axis *a, int mirror) {
    /* int16 pairs (r0, r1), (g0, g1), (b0, b1), (0, 0) from the bytes r0 g0 b0 r1 g1 b1. */
    const __m256i spread = _mm256_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1,
                                            0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
    const __m256i half = _mm256_set1_epi32(1 << (a->precision - 1));
    const size_t stride = (size_t)in_width * 3, out_stride = (size_t)out_width * 3;
    int y = 0;
    for (; in_width >= 2 && y + 4 < rows; y += 4) {
        const uint8_t *row = src + (size_t)y * stride;
        uint8_t *out = dst + (size_t)y * out_stride;
        for (int o = 0; o < out_width; o++) {
            const int x = mirror ? out_width - 1 - o : o;
            const uint8_t *p = row + (size_t)a->first[x] * 3;
            const int32_t *w = a->pairs + (size_t)x * a->pair_count;
            __m256i acc01 = half, acc23 = half;
            for (int q = 0; 2 * q < a->count[x]; q++, p += 6) {
                const __m256i weights = _mm256_set1_epi32(w[q]);
                const __m256i px01 = _mm256_set_m128i(_mm_loadl_epi64((const __m128i *)(p + stride)),
                                                      _mm_loadl_epi64((const __m128i *)p));
                const __m256i px23 = _mm256_set_m128i(_mm_loadl_epi64((const __m128i *)(p + 3 * stride)),
                                                      _mm_loadl_epi64((const __m128i *)(p + 2 * stride)));
                acc01 = _mm256_add_epi32(acc01, _mm256_madd_epi16(_mm256_shuffle_epi8(px01, spread), weights));
                acc23 = _mm256_add_epi32(acc23, _mm256_madd_epi16(_mm256_shuffle_epi8(px23, spread), weights));
            }
            /* per lane: one row's r g b in bytes 0-2 */
            const __m256i v = _mm256_packus_epi16(_mm256_packs_epi32(_mm256_srai_epi32(acc01, a->precision),
                                                                     _mm256_srai_epi32(acc23, a->precision)),
                                                  half);
            /* after the packs: row 0 in bytes 0-2, row 2 in 4-6, row 1 in 16-18, row 3 in 20-22 */
            const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
            const int32_t rgb[4] = {_mm_cvtsi128_si32(lo), _mm_cvtsi128_si32(hi), _mm_extract_epi32(lo, 1),
                                    _mm_extract_epi32(hi, 1)};
            if (o + 1 < out_width) {
                for (int r = 0; r < 4; r++) memcpy(out + (size_t)r * out_stride + (size_t)o * 3, &rgb[r], 4);
            } else {
                for (int r = 0; r < 4; r++) memcpy(out + (size_t)r * out_stride + (size_t)o * 3, &rgb[r], 3);
            }
        }
    }
    horizontal(src + (size_t)y * stride, rows - y, in_width, dst + (size_t)y * out_stride, out_width, a, mirror);
}

/* 32 bytes of a row at a time, two source rows per multiply-add: their bytes interleaved and
   widened to int16 pairs.  The unpacks work within 128-bit lanes and so do the packs that
   narrow the sums again, so the bytes come out in order. */
__attribute__((target("avx2"))) static void vertical_avx2(const uint8_t *src, int width, uint8_t *dst,
                                                          int out_rows, const struct axis *a) {
    const size_t n = (size_t)width * 3, whole = n / 32 * 32;
    const __m256i zero = _mm256_setzero_si256(), half = _mm256_set1_epi32(1 << (a->precision - 1));
    for (int y = 0; y < out_rows; y++) {
        const uint8_t *first = src + (size_t)a->first[y] * n;
        const int32_t *w = a->pairs + (size_t)y * a->pair_count;
        const int count = a->count[y];
        uint8_t *out = dst + (size_t)y * n;
        for (size_t i = 0; i < whole; i += 32) {
            __m256i acc0 = half, acc1 = half, acc2 = half, acc3 = half;
            for (int j = 0; j < count; j += 2) {
                const __m256i top = _mm256_loadu_si256((const __m256i *)(first + (size_t)j * n + i));
                const __m256i next = j + 1 < count ? _mm256_loadu_si256((const __m256i *)(first + (size_t)(j + 1) * n + i)) : zero;
                const __m256i weights = _mm256_set1_epi32(w[j / 2]);
                const __m256i lo = _mm256_unpacklo_epi8(top, next), hi = _mm256_unpackhi_epi8(top, next);
                acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), weights));
                acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), weights));
                acc2 = _mm256_add_epi32(acc2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), weights));
                acc3 = _mm256_add_epi32(acc3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), weights));
            }
            const int p = a->precision;
            const __m256i low = _mm256_packs_epi32(_mm256_srai_epi32(acc0, p), _mm256_srai_epi32(acc1, p));
            const __m256i high = _mm256_packs_epi32(_mm256_srai_epi32(acc2, p), _mm256_srai_epi32(acc3, p));
            _mm256_storeu_si256((__m256i *)(out + i), _mm256_packus_epi16(low, high));
        }
        for (size_t i = whole; i < n; i++) {
            int32_t acc = 1 << (a->precision - 1);
            for (int j = 0; j < count; j++) acc += first[(size_t)j * n + i] * a->weights[(size_t)y * a->taps + j];
            out[i] = clamp8(acc, a->precision);
        }
    }
}
#endif

static void mirror_rows(uint8_t *pixels, int rows, int width) {
    for (int y = 0; y < rows; y++) {
        uint8_t *row = pixels + (size_t)y * width * 3, t[3];
        for (int x = 0; x < width / 2; x++) {
            uint8_t *l = row + (size_t)x * 3, *r = row + (size_t)(width - 1 - x) * 3;
            memcpy(t, l, 3);
            memcpy(l, r, 3);
            memcpy(r, t, 3);
        }
    }
}

int resample_rgb8(const uint8_t *src, int height, int width, uint8_t *dst, int out_height, int out_width,
                  int mirror, int vectors) {
    const int across = out_width != width, down = out_height != height;
    struct axis h = {0}, v = {0};
    uint8_t *mid = NULL;
    int32_t *acc = NULL;
    int rc = -1;
#ifdef HAVE_AVX2
    vectors = vectors && __builtin_cpu_supports("avx2");
#else
    vectors = 0;
#endif
    if (across && axis_init(&h, width, out_width) != 0) goto done;
    if (down && axis_init(&v, height, out_height) != 0) goto done;
    /* Mirroring the columns commutes with the vertical pass, so the horizontal one mirrors. */
    uint8_t *across_to = dst; /* the horizontal pass's rows: the output, or rows for the vertical pass */
    if (across && down && (across_to = mid = malloc((size_t)height * out_width * 3)) == NULL) goto done;
    if (across) {
#ifdef HAVE_AVX2
        if (vectors)
            horizontal_avx2(src, height, width, across_to, out_width, &h, mirror);
        else
#endif
            horizontal(src, height, width, across_to, out_width, &h, mirror);
    } else if (!down) {
        memcpy(dst, src, (size_t)height * width * 3);
    }
    if (down) {
        const uint8_t *down_from = across ? mid : src;
#ifdef HAVE_AVX2
        if (vectors)
            vertical_avx2(down_from, out_width, dst, out_height, &v);
        else
#endif
        {
            if ((acc = malloc((size_t)out_width * 3 * sizeof *acc)) == NULL) goto done;
            vertical(down_from, out_width, dst, out_height, &v, acc);
        }
    }
    if (mirror && !across) mirror_rows(dst, out_height, out_width);
    rc = 0;
done:
    axis_free(&h);
    axis_free(&v);
    free(mid);
    free(acc);
    return rc;
}
