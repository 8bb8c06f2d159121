/* Decode only the part of a JPEG that a crop keeps: prefetchd.daemon._cropjpeg.
 *
 * Optional: setup.py builds it when a C compiler and libjpeg-turbo's headers are
 * present (Debian: libjpeg62-turbo-dev, Ubuntu: libjpeg-turbo8-dev); without it
 * prefetchd decodes whole images (prefetchd/daemon/jpeg_crop.py says which runs).
 *
 * libjpeg-turbo's own partial decoding (>= 1.5), as DALI's CPU decoder uses it:
 * jpeg_skip_scanlines() passes over the rows above the box without inverse DCT,
 * upsampling or colour conversion; jpeg_crop_scanline() narrows every row to the
 * iMCU columns around the box.  The window asked for is two pixels wider than the
 * box on each side (where the image has them): libjpeg treats the window's edge
 * like the image's edge when it upsamples chroma, so without the margin the box's
 * first or last column differs from a full decode by up to ~10 levels (measured
 * on 4:2:0 photos); with it the box is bit-identical to the full decode's crop.
 *
 * After the box, the rest of the stream is still entropy-decoded (skipped rows,
 * then jpeg_finish_decompress): a file that is corrupt or truncated below the box
 * must fail here as it fails a full decode, so that a machine with this module
 * accepts and refuses exactly the files one without it does.  Any libjpeg
 * warning counts as an error for the same reason; the caller then falls back to
 * the full decode, which decides (and names the problem) as it always has.
 * Only for a file whose whole stream has decoded cleanly before (the caller
 * remembers which: jpeg_crop.CleanFiles) may the decode stop after the box's
 * last row (to_end=False): the pixels are the same, ~0.1 ms sooner.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

#include "_resample.h"

#if !defined(LIBJPEG_TURBO_VERSION_NUMBER) || LIBJPEG_TURBO_VERSION_NUMBER < 2000000
#error "needs libjpeg-turbo >= 2.0 (jpeg_crop_scanline, jpeg_skip_scanlines)"
#endif

#define MARGIN 2 /* pixels beyond the box on each side, for chroma upsampling */

static PyObject *DecodeError;

struct error_manager {
    struct jpeg_error_mgr pub;
    jmp_buf escape;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct error_manager *err = (struct error_manager *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->escape, 1);
}

/* The layouts partial decoding is tested on (tests/daemon/test_jpeg_crop.py): grayscale, and
   4:4:4, 4:2:2 or 4:2:0 (luma sampled 1x1, 2x1 or 2x2, chroma 1x1).  Rarer ones (4:4:0, 4:1:1) had
   jpeg_skip_scanlines() bugs in some libjpeg-turbo releases: they decode in full instead. */
static int tested_sampling(const struct jpeg_decompress_struct *cinfo) {
    if (cinfo->num_components == 1) return 1;
    if (cinfo->num_components != 3) return 0;
    int h = cinfo->comp_info[0].h_samp_factor, v = cinfo->comp_info[0].v_samp_factor;
    if (!((h == 1 && v == 1) || (h == 2 && v == 1) || (h == 2 && v == 2))) return 0;
    for (int c = 1; c < 3; c++)
        if (cinfo->comp_info[c].h_samp_factor != 1 || cinfo->comp_info[c].v_samp_factor != 1) return 0;
    return 1;
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) on_error(cinfo); /* a warning: corrupt data that a full decode would also meet */
}

/* decode_box(data, scale_denom, left, top, right, bottom, to_end=True) -> bytearray
 *
 * The box [left, right) x [top, bottom) of the image decoded at 1/scale_denom
 * (box in scaled pixels), as (bottom - top) rows of (right - left) RGB pixels;
 * to_end=False stops after the box's last row. */
static PyObject *decode_box(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    int denom, left, top, right, bottom, to_end = 1;
    if (!PyArg_ParseTuple(args, "y*iiiii|p", &data, &denom, &left, &top, &right, &bottom, &to_end)) return NULL;

    struct jpeg_decompress_struct cinfo;
    struct error_manager err;
    PyObject *result = NULL;
    JSAMPLE *volatile row = NULL;
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.message[0] = '\0';
    jpeg_create_decompress(&cinfo);
    volatile int failed = 0;

    Py_BEGIN_ALLOW_THREADS
    if (setjmp(err.escape)) {
        failed = 1;
    } else {
        jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
        jpeg_read_header(&cinfo, TRUE);
        if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
            cinfo.jpeg_color_space != JCS_RGB) {
            snprintf(err.message, sizeof err.message, "colour space %d is not YCbCr, RGB or grayscale",
                     (int)cinfo.jpeg_color_space);
            failed = 1;
        } else if (!tested_sampling(&cinfo)) {
            snprintf(err.message, sizeof err.message, "chroma subsampling other than 4:4:4, 4:2:2 or 4:2:0");
            failed = 1;
        } else {
            cinfo.out_color_space = JCS_RGB;
            cinfo.scale_num = 1;
            cinfo.scale_denom = (unsigned int)denom;
            jpeg_start_decompress(&cinfo);
            int width = (int)cinfo.output_width, height = (int)cinfo.output_height;
            if (left < 0 || top < 0 || right > width || bottom > height || left >= right || top >= bottom) {
                snprintf(err.message, sizeof err.message, "box (%d, %d, %d, %d) is not inside %d x %d", left, top,
                         right, bottom, width, height);
                failed = 1;
            } else {
                JDIMENSION x = (JDIMENSION)(left > MARGIN ? left - MARGIN : 0);
                JDIMENSION w = (JDIMENSION)((right + MARGIN < width ? right + MARGIN : width) - (int)x);
                if (x > 0 || w < (JDIMENSION)width) jpeg_crop_scanline(&cinfo, &x, &w); /* x down to an iMCU edge */
                size_t out_row = (size_t)(right - left) * 3;
                size_t skip = (size_t)(left - (int)x) * 3;
                /* The GIL is released while libjpeg runs: rows go to a private buffer, and the
                   bytearray is made from it afterwards. */
                row = (JSAMPLE *)malloc((size_t)w * 3 * (size_t)(bottom - top + 1)); /* + a scratch row */
                if (row == NULL) {
                    snprintf(err.message, sizeof err.message, "out of memory");
                    failed = 1;
                } else {
                    if (top > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)top);
                    for (int r = 0; r < bottom - top; r++) {
                        JSAMPROW dst = row + (size_t)r * w * 3;
                        jpeg_read_scanlines(&cinfo, &dst, 1);
                    }
                    /* Compact the rows to the box's columns, in place (each row moves left). */
                    for (int r = 0; r < bottom - top; r++)
                        memmove(row + (size_t)r * out_row, row + (size_t)r * w * 3 + skip, out_row);
                    if (to_end) {
                        /* Skipping to the very end would only mark the input done, reading nothing: skip
                           to the last row and decode that one, so every row's data is entropy-decoded. */
                        JDIMENSION rest = cinfo.output_height - cinfo.output_scanline;
                        if (rest > 1) jpeg_skip_scanlines(&cinfo, rest - 1);
                        if (rest > 0) {
                            JSAMPROW last = row + (size_t)w * 3 * (size_t)(bottom - top);
                            jpeg_read_scanlines(&cinfo, &last, 1);
                        }
                        jpeg_finish_decompress(&cinfo);
                    }
                }
            }
        }
    }
    Py_END_ALLOW_THREADS

    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    if (!failed) result = PyByteArray_FromStringAndSize((const char *)row, (Py_ssize_t)(right - left) * 3 * (bottom - top));
    free(row);
    if (failed) {
        PyErr_SetString(DecodeError, err.message[0] ? err.message : "libjpeg failed");
        return NULL;
    }
    return result;
}

/* -- plain_header ---------------------------------------------------------------------------
 *
 * The stored size and EXIF orientation of a plain JPEG, from its markers alone: what the
 * augmentation plan and the crop need before any pixel is decoded, in well under a microsecond
 * where Pillow's header parser takes ~22 us (it also parses the quantisation tables and builds
 * dictionaries; tools/decode_floor.py).
 *
 * "Plain" is what Pillow opens, and reads the same way, by construction: well-formed segments up
 * to the first scan; one baseline, extended or progressive 8-bit frame of 1 or 3 components;
 * whole quantisation tables; no MPO index, XMP packet (Pillow takes an orientation from XMP where
 * EXIF has none) or Photoshop block; JFIF, Adobe and ICC segments long enough for Pillow's reads;
 * and at most one EXIF segment, whose first directory lies wholly inside it, with at most one
 * orientation entry (a SHORT of 1 to 8) and an X resolution, if any, of one RATIONAL (Pillow
 * reads it for the DPI and fails on some other types).  Anything else gives None and Pillow's
 * reading decides, as it always has.  tests/daemon/test_plain_header.py checks, also on mutated
 * headers, that Pillow opens every file this reads and agrees on its size and orientation;
 * tests/daemon/test_resample.py runs it under AddressSanitizer on damaged and cut headers. */

static unsigned get16(const unsigned char *p, int little) { return little ? p[0] | p[1] << 8 : p[0] << 8 | p[1]; }

static uint32_t get32(const unsigned char *p, int little) {
    return little ? (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24
                  : (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* The orientation in the TIFF structure t[0:n] of an EXIF segment: 1 to 8, or 0 where it is not plain. */
static int exif_orientation(const unsigned char *t, size_t n) {
    /* Bytes per value of TIFF types 1 to 13 (BYTE .. IFD); Pillow reads these and, where one's values
       lie outside the data, stops reading the directory there.  Other types: not plain. */
    static const unsigned char unit[] = {0, 1, 1, 2, 4, 8, 1, 1, 2, 4, 8, 4, 8, 4};
    if (n < 8) return 0;
    int little = t[0] == 'I' && t[1] == 'I';
    if (!little && !(t[0] == 'M' && t[1] == 'M')) return 0;
    if (get16(t + 2, little) != 42) return 0;
    uint64_t ifd = get32(t + 4, little);
    if (ifd < 8 || ifd + 2 > n) return 0;
    uint64_t entries = get16(t + ifd, little);
    if (ifd + 2 + 12 * entries + 4 > n) return 0;
    int orientation = 1, seen = 0;
    for (uint64_t i = 0; i < entries; i++) {
        const unsigned char *e = t + ifd + 2 + 12 * i;
        unsigned tag = get16(e, little), type = get16(e + 2, little);
        uint64_t count = get32(e + 4, little);
        if (type == 0 || type >= sizeof unit) return 0;
        uint64_t size = count * unit[type];
        if (size > 4 && get32(e + 8, little) + size > n) return 0;
        if (tag == 0x011A && (type != 5 || count != 1)) return 0;
        if (tag == 0x0112) {
            if (seen || type != 3 || count != 1) return 0;
            orientation = (int)get16(e + 8, little);
            seen = 1;
            if (orientation < 1 || orientation > 8) return 0;
        }
    }
    return orientation;
}

static int starts(const unsigned char *seg, size_t len, const char *prefix, size_t n) {
    return len >= n && memcmp(seg, prefix, n) == 0;
}

static PyObject *plain_header(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    const unsigned char *b = (const unsigned char *)data.buf;
    size_t n = (size_t)data.len, pos = 2;
    long width = 0, height = 0;
    int orientation = 1, exif_segments = 0, plain = n >= 4 && b[0] == 0xFF && b[1] == 0xD8;
    while (plain) {
        if (pos + 4 > n || b[pos] != 0xFF) { plain = 0; break; }
        unsigned marker = b[pos + 1];
        size_t len = get16(b + pos + 2, 0);
        if (len < 2 || pos + 2 + len > n) { plain = 0; break; }
        const unsigned char *seg = b + pos + 4;
        size_t seg_len = len - 2;
        if (marker == 0xDA) break; /* the first scan: the header is read */
        if (marker == 0xE1 && starts(seg, seg_len, "Exif\0\0", 6)) {
            exif_segments++;
            orientation = exif_orientation(seg + 6, seg_len - 6);
            if (exif_segments > 1 || orientation == 0) plain = 0;
        } else if ((marker == 0xE1 && starts(seg, seg_len, "http://ns.adobe.com/xap/1.0/\0", 29)) ||
                   (marker == 0xE2 && starts(seg, seg_len, "MPF\0", 4)) ||
                   (marker == 0xED && starts(seg, seg_len, "Photoshop 3.0\0", 14)) ||
                   (marker == 0xE0 && starts(seg, seg_len, "JFIF", 4) && seg_len < 14) ||
                   (marker == 0xEE && starts(seg, seg_len, "Adobe", 5) && seg_len < 12) ||
                   (marker == 0xE2 && starts(seg, seg_len, "ICC_PROFILE\0", 12) && seg_len < 14)) {
            plain = 0;
        } else if (marker == 0xDB) { /* whole tables: a precision byte, then 64 values of 8 or 16 bits */
            size_t at = 0;
            while (at < seg_len) at += 1 + (seg[at] >> 4 ? 128 : 64);
            if (at != seg_len) plain = 0;
        } else if (marker == 0xC0 || marker == 0xC1 || marker == 0xC2) { /* baseline, extended, progressive */
            if (width != 0 || seg_len < 6 || seg[0] != 8 || (seg[5] != 1 && seg[5] != 3) || seg_len != 6 + 3 * (size_t)seg[5]) {
                plain = 0;
                break;
            }
            height = (long)get16(seg + 1, 0);
            width = (long)get16(seg + 3, 0);
            if (width == 0 || height == 0) plain = 0;
        } else if (!((marker >= 0xE0 && marker <= 0xEF) || marker == 0xFE || marker == 0xC4 || marker == 0xDD)) {
            plain = 0; /* lossless, arithmetic-coded or hierarchical frames, fill bytes, stray markers */
        }
        pos += 2 + len;
    }
    PyBuffer_Release(&data);
    if (!plain || width == 0) Py_RETURN_NONE;
    return Py_BuildValue("lli", width, height, orientation);
}

static PyObject *resize(PyObject *self, PyObject *args) {
    Py_buffer pixels, target = {0};
    int height, width, out_height, out_width, mirror, vectors = 1;
    PyObject *into = Py_None;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iiiip|pO", &pixels, &height, &width, &out_height, &out_width, &mirror, &vectors,
                          &into))
        return NULL;
    Py_ssize_t out_len = (Py_ssize_t)out_height * out_width * 3;
    if (height < 1 || width < 1 || out_height < 1 || out_width < 1 ||
        pixels.len != (Py_ssize_t)height * width * 3) {
        PyErr_Format(PyExc_ValueError, "resize: %zd bytes are not %d x %d x 3 pixels, or a size is below 1",
                     pixels.len, height, width);
        PyBuffer_Release(&pixels);
        return NULL;
    }
    PyObject *out;
    uint8_t *dst;
    if (into == Py_None) {
        out = PyByteArray_FromStringAndSize(NULL, out_len);
        if (out == NULL) {
            PyBuffer_Release(&pixels);
            return NULL;
        }
        dst = (uint8_t *)PyByteArray_AS_STRING(out);
    } else { /* the caller's writable, contiguous buffer: a batch slot, written in place */
        if (PyObject_GetBuffer(into, &target, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
            PyBuffer_Release(&pixels);
            return NULL;
        }
        if (target.len != out_len) {
            PyErr_Format(PyExc_ValueError, "resize: a target of %zd bytes for %d x %d x 3 pixels",
                         target.len, out_height, out_width);
            PyBuffer_Release(&target);
            PyBuffer_Release(&pixels);
            return NULL;
        }
        out = Py_NewRef(into);
        dst = (uint8_t *)target.buf;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = resample_rgb8((const uint8_t *)pixels.buf, height, width, dst, out_height, out_width, mirror, vectors);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&pixels);
    if (into != Py_None) PyBuffer_Release(&target);
    if (rc != 0) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    return out;
}

static PyMethodDef methods[] = {
    {"decode_box", decode_box, METH_VARARGS,
     "decode_box(data, scale_denom, left, top, right, bottom, to_end=True) -> bytearray of the box's RGB rows; "
     "raises DecodeError where a full decode would fail or warn; to_end=False stops after the box's last row "
     "(for a file known to decode cleanly: it may accept damage that only the rest of the file shows)."},
    {"plain_header", plain_header, METH_VARARGS,
     "plain_header(data) -> (width, height, orientation) of a plain JPEG (stored size, EXIF orientation 1-8), "
     "read from its markers; None for any other file, which Pillow's header parser then reads."},
    {"resize", resize, METH_VARARGS,
     "resize(pixels, height, width, out_height, out_width, mirror, vectors=True, into=None) -> bytearray, or "
     "into: H x W x 3 uint8 pixels resized as torch's antialiased bilinear uint8 kernel does, columns mirrored "
     "if mirror, into a new bytearray or the writable buffer into; vectors=False keeps to the portable C (the same bytes)."},
    {NULL, NULL, 0, NULL},
};

/* The digest of the sources it was built from (setup.py; extension_sources.py), which jpeg_crop compares with the
 * sources beside it.  A build without it (by hand) has none, and is told to be built again. */
#ifndef PREFETCHD_SOURCE_DIGEST
#define PREFETCHD_SOURCE_DIGEST ""
#endif

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cropjpeg", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cropjpeg(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    DecodeError = PyErr_NewException("prefetchd.daemon._cropjpeg.DecodeError", PyExc_ValueError, NULL);
    if (DecodeError == NULL || PyModule_AddObject(m, "DecodeError", DecodeError) < 0) {
        Py_XDECREF(DecodeError);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION_NUMBER", LIBJPEG_TURBO_VERSION_NUMBER) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_DIGEST", PREFETCHD_SOURCE_DIGEST) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
