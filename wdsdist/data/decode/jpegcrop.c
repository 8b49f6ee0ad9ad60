/* Decode only the part of a JPEG that a crop keeps (used by jpegcrop.py, which builds this file at
   pip install time or on first use: cc -O3 -shared -fPIC -pthread jpegcrop.c -ljpeg).

   libjpeg-turbo can skip work outside a region: jpeg_skip_scanlines() passes over the rows above
   it (entropy decoding only, no inverse DCT, upsampling or colour conversion), jpeg_crop_scanline()
   limits the columns that are fully decoded, and decoding stops after the region's last row.
   scale_denom 2, 4 or 8 decodes at that fraction of the size by DCT scaling. Every libjpeg error,
   and every warning in what is read (corrupt data, where libjpeg would go on with grey pixels),
   returns -1 with libjpeg's message: the caller then takes the crop from torchvision's whole
   decode, which decides. Damage below the region is not seen here; a file cut short is caught by
   the caller, which sends JPEGs that do not end with their end-of-image marker to torchvision. */
#include <pthread.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

struct error {
  struct jpeg_error_mgr mgr;
  jmp_buf jump;
  char *msg; /* JMSG_LENGTH_MAX bytes from the caller */
};

static void on_error(j_common_ptr c) {
  struct error *e = (struct error *)c->err;
  c->err->format_message(c, e->msg);
  longjmp(e->jump, 1);
}

static void on_message(j_common_ptr c, int level) {
  if (level < 0) on_error(c); /* a warning; levels >= 0 are trace messages */
}

static void start(struct jpeg_decompress_struct *cinfo, struct error *err, const unsigned char *buf,
                  unsigned long len, char *msg) {
  cinfo->err = jpeg_std_error(&err->mgr);
  err->mgr.error_exit = on_error;
  err->mgr.emit_message = on_message;
  err->msg = msg;
  jpeg_create_decompress(cinfo);
  jpeg_mem_src(cinfo, buf, len);
}

/* Whether the region x, y, w, h lies outside the image's output size (said in msg). */
static int outside(struct jpeg_decompress_struct *cinfo, int x, int y, int w, int h, char *msg) {
  if (x < 0 || y < 0 || w < 1 || h < 1 || (JDIMENSION)(x + w) > cinfo->output_width ||
      (JDIMENSION)(y + h) > cinfo->output_height) {
    snprintf(msg, JMSG_LENGTH_MAX, "region %dx%d+%d+%d is outside the %ux%u image", w, h, x, y, cinfo->output_width,
             cinfo->output_height);
    return 1;
  }
  return 0;
}

/* Limits the columns decoded to the region's, x to x + w: *xoffset, *xwidth are the columns
   libjpeg decodes (xoffset moved down to an iMCU boundary). One column more on each side: chroma
   upsampling at the edge of a decoded window differs from upsampling inside the image, and with
   the margin the region's pixels equal a whole decode's. After jpeg_start_decompress. */
static void crop_columns(struct jpeg_decompress_struct *cinfo, int x, int w, JDIMENSION *xoffset, JDIMENSION *xwidth) {
  JDIMENSION left = x > 0 ? (JDIMENSION)x - 1 : 0;
  JDIMENSION right = (JDIMENSION)(x + w + 1) < cinfo->output_width ? (JDIMENSION)(x + w + 1) : cinfo->output_width;
  *xoffset = left, *xwidth = right - left;
  jpeg_crop_scanline(cinfo, xoffset, xwidth);
}

/* The image's size into *width and *height; then, unless denom is 0, the region x, y, w, h (in
   pixels of the image decoded at 1/denom of its size) as RGB rows of w * 3 bytes into out
   (h * w * 3 bytes). */
int jpegcrop_decode(const unsigned char *buf, unsigned long len, int *width, int *height, int denom, int x, int y,
                    int w, int h, unsigned char *out, char *msg) {
  struct jpeg_decompress_struct cinfo;
  struct error err;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  start(&cinfo, &err, buf, len, msg);
  jpeg_read_header(&cinfo, TRUE);
  *width = (int)cinfo.image_width;
  *height = (int)cinfo.image_height;
  if (denom == 0) {
    jpeg_destroy_decompress(&cinfo);
    return 0;
  }
  cinfo.out_color_space = JCS_RGB;
  cinfo.scale_num = 1;
  cinfo.scale_denom = (unsigned int)denom;
  jpeg_start_decompress(&cinfo);
  if (outside(&cinfo, x, y, w, h, msg)) {
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  JDIMENSION xoffset, xwidth;
  crop_columns(&cinfo, x, w, &xoffset, &xwidth);
  JSAMPARRAY row = cinfo.mem->alloc_sarray((j_common_ptr)&cinfo, JPOOL_IMAGE, xwidth * 3, 1);
  if (y > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)y);
  for (int r = 0; r < h; r++) {
    jpeg_read_scanlines(&cinfo, row, 1);
    memcpy(out + (size_t)r * w * 3, row[0] + (size_t)(x - xoffset) * 3, (size_t)w * 3);
  }
  jpeg_destroy_decompress(&cinfo); /* without reading the rest: that is the saving */
  return 0;
}

/* ------------------------------------------------------------------ the batch kernel

   jpegcrop_batch: a batch's JPEGs, each decoded in its crop's region only, resized to the output
   size with antialiasing and maybe flipped, written as H x W x 3 rows into the batch's buffer, on
   `threads` threads, in one call that holds no lock of Python's (ctypes releases the GIL).

   The resize is torch's antialiased bilinear on uint8 (torchvision's RandomResizedCrop with
   antialias=True): per output pixel the triangle filter stretched by the scale, its weights
   normalised, then made integers of `precision` bits, the largest that keeps every weight of
   the pass under 2^15; the horizontal pass first, rounded and clamped to uint8, then the
   vertical one. The rows are resized horizontally as libjpeg hands them over, while they are in
   the cache, so the region itself is never held whole: a thread holds the region's rows at the
   output's width (h x out_w x 3 bytes, h at most the image's height). */

enum { MSG_LEN = JMSG_LENGTH_MAX, ROW_PAD = 16 /* bytes after a row that resize_rows4_avx2 may read */ };

struct taps {
  int *start, *count; /* per output pixel: the first input pixel and how many */
  int16_t *weight;    /* out x ksize */
  int ksize, precision;
  int16_t *quads; /* the horizontal pass's: per output pixel, groups of 4 taps as (w0 w1) x 4, (w2 w3) x 4 */
  int groups;     /* ksize / 4, rounded up */
};

/* Weights of an in_size -> out_size pass, as torch computes them (align_corners=False). */
static int taps_make(struct taps *t, int in_size, int out_size) {
  double scale = (double)in_size / out_size;
  double support = scale >= 1.0 ? scale : 1.0; /* bilinear: half of 2 taps, stretched when shrinking */
  double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
  int ceiled = (int)support;
  if (ceiled < support) ceiled++;
  int ksize = ceiled * 2 + 1; /* torch's bound on the taps of one output pixel */
  double *w = malloc(sizeof(double) * (size_t)out_size * ksize);
  t->start = malloc(sizeof(int) * (size_t)out_size * 2);
  t->weight = malloc(sizeof(int16_t) * (size_t)out_size * ksize);
  if (!w || !t->start || !t->weight) {
    free(w);
    free(t->start);
    free(t->weight);
    t->start = NULL, t->weight = NULL;
    return -1;
  }
  t->quads = NULL;
  t->count = t->start + out_size;
  t->ksize = ksize;
  double most = 0.0;
  for (int i = 0; i < out_size; i++) {
    double center = scale * (i + 0.5);
    int lo = (int)(center - support + 0.5);
    if (lo < 0) lo = 0;
    int hi = (int)(center + support + 0.5);
    if (hi > in_size) hi = in_size;
    int n = hi - lo;
    if (n > ksize) n = ksize;
    double total = 0.0;
    double *wi = w + (size_t)i * ksize;
    for (int j = 0; j < n; j++) {
      double x = (j + lo - center + 0.5) * invscale;
      x = x < 0 ? -x : x;
      wi[j] = x < 1.0 ? 1.0 - x : 0.0;
      total += wi[j];
    }
    for (int j = 0; j < n; j++) {
      if (total != 0.0) wi[j] /= total;
      if (wi[j] > most) most = wi[j];
    }
    for (int j = n; j < ksize; j++) wi[j] = 0.0;
    t->start[i] = lo;
    t->count[i] = n;
  }
  int precision = 0;
  for (; precision < 22; precision++) {
    int next = (int)(0.5 + most * (1 << (precision + 1)));
    if (next >= (1 << 15)) break;
  }
  t->precision = precision;
  for (size_t k = 0; k < (size_t)out_size * ksize; k++) {
    double v = w[k] * (1 << precision);
    t->weight[k] = (int16_t)(v < 0 ? (int)(v - 0.5) : (int)(v + 0.5));
  }
  free(w);
  return 0;
}

static void taps_free(struct taps *t) {
  free(t->start);
  free(t->weight);
  free(t->quads);
  t->start = NULL, t->weight = NULL, t->quads = NULL;
}

/* The weights laid out for resize_rows4_avx2: 16 per group of 4 taps, 0 past the pixel's own. */
static int taps_quads(struct taps *t, int out_size) {
  t->groups = (t->ksize + 3) / 4;
  t->quads = calloc((size_t)out_size * t->groups * 16, sizeof(int16_t));
  if (!t->quads) return -1;
  for (int x = 0; x < out_size; x++) {
    const int16_t *w = t->weight + (size_t)x * t->ksize;
    int16_t *q = t->quads + (size_t)x * t->groups * 16;
    for (int k = 0; k < t->count[x]; k++) {
      int g = k / 4, half = (k % 4) / 2, odd = k % 2;
      for (int c = 0; c < 4; c++) q[g * 16 + half * 8 + c * 2 + odd] = w[k];
    }
  }
  return 0;
}

static inline unsigned char clamp8(int32_t v) { return v < 0 ? 0 : v > 255 ? 255 : (unsigned char)v; }

/* One row of pixels of 4 bytes (RGBX, as libjpeg hands them over) -> out_w pixels of 3. */
static void resize_row_plain(const unsigned char *in, unsigned char *out, int out_w, const struct taps *t) {
  const int32_t half = 1 << (t->precision - 1);
  for (int x = 0; x < out_w; x++) {
    const unsigned char *p = in + (size_t)t->start[x] * 4;
    const int16_t *wx = t->weight + (size_t)x * t->ksize;
    int32_t acc[4] = {half, half, half, half};
    for (int k = 0; k < t->count[x]; k++, p += 4) {
      for (int c = 0; c < 4; c++) acc[c] += p[c] * wx[k];
    }
    for (int c = 0; c < 3; c++) out[x * 3 + c] = clamp8(acc[c] >> t->precision);
  }
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
/* Four rows at once, four taps per multiply-add: each pixel's bytes paired by channel, (r0 r1 g0
   g1 b0 b1 x0 x1) and (r2 r3 ...), widened to 16 bits, times taps_quads' weights, the two halves
   summed; each pixel's weights loaded once for the four rows, four independent sums in flight.
   Reads up to 3 pixels past a pixel's last tap (their weights are 0): the row has room (ROW_PAD). */
__attribute__((target("avx2"))) static void resize_rows4_avx2(unsigned char *const *in, unsigned char *const *out,
                                                             int out_w, const struct taps *t) {
  const __m128i pair = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  const int shift = t->precision;
  const __m128i half = _mm_set1_epi32(1 << (shift - 1));
  const unsigned char *r0 = in[0], *r1 = in[1], *r2 = in[2], *r3 = in[3];
  for (int x = 0; x < out_w; x++) {
    size_t at = (size_t)t->start[x] * 4;
    const __m256i *q = (const __m256i *)(t->quads + (size_t)x * t->groups * 16);
    const int groups = (t->count[x] + 3) / 4;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int g = 0; g < groups; g++, at += 16) {
      const __m256i w = _mm256_loadu_si256(q + g);
#define TAPS(acc, row) \
  acc = _mm256_add_epi32(                                                                                     \
      acc, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(row + at)), pair)), w))
      TAPS(a0, r0);
      TAPS(a1, r1);
      TAPS(a2, r2);
      TAPS(a3, r3);
#undef TAPS
    }
#define SUM(acc) \
  _mm_srai_epi32(_mm_add_epi32(_mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1)), half), shift)
    __m128i bytes = _mm_packus_epi16(_mm_packs_epi32(SUM(a0), SUM(a1)), _mm_packs_epi32(SUM(a2), SUM(a3)));
#undef SUM
    int32_t v[4];
    _mm_storeu_si128((__m128i *)v, bytes);
    for (int r = 0; r < 4; r++) memcpy(out[r] + x * 3, &v[r], 3);
  }
}
#endif

static void resize_row(const unsigned char *in, unsigned char *out, int out_w, const struct taps *t) {
#if defined(__x86_64__) || defined(__i386__)
  if (t->quads) { /* one row: the same row four times */
    unsigned char *ins[4] = {(unsigned char *)in, (unsigned char *)in, (unsigned char *)in, (unsigned char *)in};
    unsigned char *outs[4] = {out, out, out, out};
    resize_rows4_avx2(ins, outs, out_w, t);
    return;
  }
#endif
  resize_row_plain(in, out, out_w, t);
}

/* Output row y of the vertical pass: bytes [from, width) of the rows its taps name, summed. */
static void column_sums(const unsigned char *in, int width, int from, unsigned char *dst, const struct taps *t, int y) {
  const int32_t half = 1 << (t->precision - 1);
  const int16_t *wy = t->weight + (size_t)y * t->ksize;
  for (int j = from; j < width; j++) {
    int32_t acc = half;
    for (int k = 0; k < t->count[y]; k++) acc += in[(size_t)(t->start[y] + k) * width + j] * wy[k];
    dst[j] = clamp8(acc >> t->precision);
  }
}

#if defined(__x86_64__) || defined(__i386__)
/* 16 bytes at a time, two rows per multiply-add: the rows' bytes interleaved (a0 b0 a1 b1 ...),
   widened to 16 bits and multiplied by (w0 w1) pairs into 32-bit sums. Returns where it stopped. */
__attribute__((target("avx2"))) static int column_sums_avx2(const unsigned char *in, int width, unsigned char *dst,
                                                           const struct taps *t, int y) {
  const int shift = t->precision;
  const int16_t *wy = t->weight + (size_t)y * t->ksize;
  const unsigned char *first = in + (size_t)t->start[y] * width;
  const int n = t->count[y];
  const __m256i half = _mm256_set1_epi32(1 << (shift - 1));
  int j = 0;
  for (; j + 16 <= width; j += 16) {
    __m256i lo = half, hi = half;
    const unsigned char *row = first + j;
    int k = 0;
    for (; k + 1 < n; k += 2, row += 2 * (size_t)width) {
      __m128i a = _mm_loadu_si128((const __m128i *)row), b = _mm_loadu_si128((const __m128i *)(row + width));
      __m256i w = _mm256_set1_epi32((int32_t)(((uint32_t)(uint16_t)wy[k + 1] << 16) | (uint16_t)wy[k]));
      lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b)), w));
      hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(a, b)), w));
    }
    if (k < n) {
      __m128i a = _mm_loadu_si128((const __m128i *)row), zero = _mm_setzero_si128();
      __m256i w = _mm256_set1_epi32((uint16_t)wy[k]);
      lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, zero)), w));
      hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(a, zero)), w));
    }
    lo = _mm256_srai_epi32(lo, shift);
    hi = _mm256_srai_epi32(hi, shift);
    __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8); /* 16 sums in order */
    __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128((__m128i *)(dst + j), bytes);
  }
  return j;
}
#endif

/* Rows of `width` bytes -> out_h rows; row y of the result is written at out + y * width,
   reversed pixel by pixel when flipped. */
static void resize_columns(const unsigned char *in, int width, unsigned char *out, int out_h, const struct taps *t,
                           unsigned char *line, int flip) {
#if defined(__x86_64__) || defined(__i386__)
  const int wide = __builtin_cpu_supports("avx2");
#endif
  for (int y = 0; y < out_h; y++) {
    unsigned char *o = out + (size_t)y * width;
    unsigned char *dst = flip ? line : o;
    int done = 0;
#if defined(__x86_64__) || defined(__i386__)
    if (wide) done = column_sums_avx2(in, width, dst, t, y);
#endif
    column_sums(in, width, done, dst, t, y);
    if (flip) {
      int n = width / 3;
      for (int x = 0; x < n; x++) memcpy(o + (size_t)(n - 1 - x) * 3, line + (size_t)x * 3, 3);
    }
  }
}

/* Row r of n pixels reversed in place. */
static void flip_row(unsigned char *o, int n) {
  for (int a = 0, b = n - 1; a < b; a++, b--) {
    unsigned char t[3];
    memcpy(t, o + a * 3, 3);
    memcpy(o + a * 3, o + b * 3, 3);
    memcpy(o + b * 3, t, 3);
  }
}

struct scratch {
  unsigned char *rows; /* the region's rows at the output's width */
  unsigned char *line; /* a row before it is flipped */
  size_t rows_size;
};

/* One sample: 0, or -1 with libjpeg's message (or ours) in msg. */
static int render(const unsigned char *buf, unsigned long len, const int *p, int out_h, int out_w, unsigned char *out,
                  struct scratch *s, char *msg) {
  int denom = p[0], x = p[1], y = p[2], w = p[3], h = p[4], flip = p[5];
  if (w < 1 || h < 1) {
    snprintf(msg, MSG_LEN, "region %dx%d is empty", w, h);
    return -1;
  }
  /* The weights and the room for the rows, made before libjpeg runs: nothing of them changes
     after setjmp, so the error path frees what was made. */
  struct taps across = {0}, down = {0};
  int quads = 0;
#if defined(__x86_64__) || defined(__i386__)
  quads = __builtin_cpu_supports("avx2");
#endif
  size_t need = (size_t)h * out_w * 3;
  if (need > s->rows_size) {
    unsigned char *grown = realloc(s->rows, need);
    if (grown) s->rows = grown, s->rows_size = need;
  }
  if (need > s->rows_size || (w != out_w && (taps_make(&across, w, out_w) || (quads && taps_quads(&across, out_w)))) ||
      (h != out_h && taps_make(&down, h, out_h))) {
    snprintf(msg, MSG_LEN, "out of memory for a %dx%d region", w, h);
    taps_free(&across);
    taps_free(&down);
    return -1;
  }
  struct jpeg_decompress_struct cinfo;
  struct error err;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    taps_free(&across);
    taps_free(&down);
    return -1;
  }
  start(&cinfo, &err, buf, len, msg);
  jpeg_read_header(&cinfo, TRUE);
  cinfo.out_color_space = JCS_EXT_RGBX; /* the same pixels as JCS_RGB, each padded to 4 bytes */
  cinfo.scale_num = 1;
  cinfo.scale_denom = (unsigned int)denom;
  jpeg_calc_output_dimensions(&cinfo);
  if (outside(&cinfo, x, y, w, h, msg)) {
    jpeg_destroy_decompress(&cinfo);
    taps_free(&across);
    taps_free(&down);
    return -1;
  }
  jpeg_start_decompress(&cinfo);
  JDIMENSION xoffset, xwidth;
  crop_columns(&cinfo, x, w, &xoffset, &xwidth);
  JSAMPARRAY row = cinfo.mem->alloc_sarray((j_common_ptr)&cinfo, JPOOL_IMAGE, xwidth * 4 + ROW_PAD, 4);
  if (y > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)y);
  /* Without a vertical pass the rows go straight to the output. */
  unsigned char *rows = h == out_h ? out : s->rows;
  for (int r = 0; r < h;) {
    int got = 0; /* up to 4 rows at a time: resize_rows4_avx2 takes them together */
    while (got < 4 && r + got < h) got += (int)jpeg_read_scanlines(&cinfo, row + got, (JDIMENSION)(4 - got));
    if (got > h - r) got = h - r;
    unsigned char *in[4], *dst[4];
    for (int i = 0; i < got; i++) {
      in[i] = row[i] + (size_t)(x - xoffset) * 4;
      dst[i] = rows + (size_t)(r + i) * out_w * 3;
    }
#if defined(__x86_64__) || defined(__i386__)
    if (w != out_w && got == 4 && across.quads) {
      resize_rows4_avx2(in, dst, out_w, &across);
      r += got;
      continue;
    }
#endif
    for (int i = 0; i < got; i++) {
      if (w != out_w) {
        resize_row(in[i], dst[i], out_w, &across);
      } else {
        for (int c = 0; c < w; c++) memcpy(dst[i] + c * 3, in[i] + c * 4, 3);
      }
    }
    r += got;
  }
  jpeg_destroy_decompress(&cinfo);
  if (h != out_h) {
    resize_columns(s->rows, out_w * 3, out, out_h, &down, s->line, flip);
  } else if (flip) { /* rows written in place: reverse each */
    for (int r = 0; r < out_h; r++) flip_row(out + (size_t)r * out_w * 3, out_w);
  }
  taps_free(&across);
  taps_free(&down);
  return 0;
}

struct batch {
  int n, out_h, out_w;
  const unsigned char *const *bufs;
  const unsigned long *lens;
  const int *params; /* n x 6: denom, x, y, w, h, flip */
  unsigned char *const *outs; /* per sample, where its out_h x out_w x 3 bytes go */
  int *status;
  char *msgs; /* n x MSG_LEN */
  int next;   /* the next sample a thread takes */
};

static void *work(void *arg) {
  struct batch *b = arg;
  struct scratch s = {0};
  s.line = malloc((size_t)b->out_w * 3);
  for (;;) {
    int i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
    if (i >= b->n) break;
    char *msg = b->msgs + (size_t)i * MSG_LEN;
    if (!s.line) {
      snprintf(msg, MSG_LEN, "out of memory");
      b->status[i] = -1;
      continue;
    }
    b->status[i] = render(b->bufs[i], b->lens[i], b->params + (size_t)i * 6, b->out_h, b->out_w,
                          b->outs[i], &s, msg);
  }
  free(s.rows);
  free(s.line);
  return NULL;
}

/* n samples on `threads` threads (the caller's among them), sample i into outs[i]. status[i]: 0,
   or -1 with a message at msgs + i * JMSG_LENGTH_MAX (that image's pixels are then undefined).
   Returns how many failed. */
int jpegcrop_batch(int n, const unsigned char *const *bufs, const unsigned long *lens, const int *params, int out_h,
                   int out_w, unsigned char *const *outs, int threads, int *status, char *msgs) {
  struct batch b = {n, out_h, out_w, bufs, lens, params, outs, status, msgs, 0};
  if (threads > n) threads = n;
  if (threads > 64) threads = 64;
  pthread_t ids[64];
  int started = 0;
  for (int t = 1; t < threads; t++) {
    if (pthread_create(&ids[started], NULL, work, &b) == 0) started++;
  }
  work(&b);
  for (int t = 0; t < started; t++) pthread_join(ids[t], NULL);
  int failed = 0;
  for (int i = 0; i < n; i++) failed += status[i] != 0;
  return failed;
}

#ifndef JPEGCROP_TAG
#define JPEGCROP_TAG "" /* set by setup.py: the source's hash, as jpegcrop.py names its own builds */
#endif
const char *jpegcrop_tag(void) { return JPEGCROP_TAG; }
