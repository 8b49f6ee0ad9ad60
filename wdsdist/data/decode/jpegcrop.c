/* Decode only the part of a JPEG that a crop keeps (used by jpegcrop.py, which builds this file at
   pip install time or on first use: cc -O3 -ffp-contract=off -shared -fPIC jpegcrop.c -ljpeg -lm).
   Below the decoder: the augmentations' C loops (augment_ops.py).

   libjpeg-turbo can skip work outside a region: jpeg_skip_scanlines() passes over the rows above
   it (entropy decoding only, no inverse DCT, upsampling or colour conversion), jpeg_crop_scanline()
   limits the columns that are fully decoded, and decoding stops after the region's last row.
   scale_denom 2, 4 or 8 decodes at that fraction of the size by DCT scaling. Every libjpeg error,
   and every warning in what is read (corrupt data, where libjpeg would go on with grey pixels),
   returns -1 with libjpeg's message: the caller then takes the crop from torchvision's whole
   decode, which decides. Damage below the region is not seen here; a file cut short is caught by
   the caller, which sends JPEGs that do not end with their end-of-image marker to torchvision. */
#include <setjmp.h>
#include <stdio.h>
#include <math.h>
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

/* The augmentations' ops (augment_ops.py), in Pillow's own arithmetic so that their pixels equal
   torchvision's functional ops on a PIL image bit for bit, at a fraction of PIL's cost (its
   affine calls two functions per pixel through pointers). -ffp-contract=off: no fused
   multiply-adds, which would round otherwise. Images are packed HWC RGB, uint8. */

#define FLOOR(v) ((v) < 0.0 ? (int)floor(v) : (int)(v))
#define CLIP(v, n) ((v) < 0 ? 0 : (v) < (n) ? (v) : (n) - 1)

/* A translation by whole pixels, where bilinear weights are 0 and 1: rows copied, the rest filled. */
static void shift(const unsigned char *in, int w, int h, unsigned char *out, int dx, int dy,
                  const unsigned char *fill) {
  int x0 = dx < 0 ? -dx : 0, x1 = w - dx < w ? w - dx : w; /* output columns with a source */
  for (int y = 0; y < h; y++) {
    unsigned char *o = out + (size_t)y * w * 3;
    int from = y + dy;
    for (int x = 0; x < w; x++) {
      if (from >= 0 && from < h && x >= x0 && x < x1) {
        memcpy(o + (size_t)x * 3, in + ((size_t)from * w + x + dx) * 3, (size_t)(x1 - x) * 3);
        x = x1 - 1;
      } else {
        o[x * 3] = fill[0], o[x * 3 + 1] = fill[1], o[x * 3 + 2] = fill[2];
      }
    }
  }
}

/* augment_affine where yin = y + 0.5 exactly: only xin varies, and PIL's vertical weight is 0. */
static void shear_rows(const unsigned char *in, int w, int h, unsigned char *out, const double *a,
                       const unsigned char *fill, const double *u8) {
  for (int y = 0; y < h; y++) {
    const double yx = a[1] * (y + 0.5);
    const unsigned char *r = in + (size_t)y * w * 3;
    unsigned char *o = out + (size_t)y * w * 3;
    for (int x = 0; x < w; x++, o += 3) {
      double xin = a[0] * (x + 0.5) + yx + a[2];
      if (xin < 0.0 || xin >= w) {
        o[0] = fill[0], o[1] = fill[1], o[2] = fill[2];
        continue;
      }
      xin -= 0.5;
      int xi = FLOOR(xin);
      double dx = xin - xi;
      int x0 = CLIP(xi, w) * 3, x1 = CLIP(xi + 1, w) * 3;
      for (int b = 0; b < 3; b++) o[b] = (unsigned char)(u8[r[x0 + b]] + (u8[r[x1 + b]] - u8[r[x0 + b]]) * dx);
    }
  }
}

/* Image.transform(AFFINE, a, BILINEAR): ImagingGenericTransform with affine_transform and
   bilinear_filter32RGB (Pillow's Geometry.c). Output pixels whose source falls outside the image
   take ``fill``. */
void augment_affine(const unsigned char *in, int w, int h, unsigned char *out, const double *a,
                    const unsigned char *fill) {
  if (a[0] == 1.0 && a[1] == 0.0 && a[3] == 0.0 && a[4] == 1.0 && a[2] > -w && a[2] < w && a[5] > -h &&
      a[5] < h && a[2] == (int)a[2] && a[5] == (int)a[5]) {
    shift(in, w, h, out, (int)a[2], (int)a[5], fill);
    return;
  }
  double u8[256]; /* each byte as a double: a load instead of a conversion, the same values */
  for (int v = 0; v < 256; v++) u8[v] = v;
  if (a[3] == 0.0 && a[4] == 1.0 && a[5] == 0.0) { /* ShearX: the source row is y itself (dy 0) */
    shear_rows(in, w, h, out, a, fill, u8);
    return;
  }
  for (int y = 0; y < h; y++) {
    const double yx = a[1] * (y + 0.5), yy = a[4] * (y + 0.5);
    for (int x = 0; x < w; x++) {
      double xin = a[0] * (x + 0.5) + yx + a[2];
      double yin = a[3] * (x + 0.5) + yy + a[5];
      unsigned char *o = out + ((size_t)y * w + x) * 3;
      if (xin < 0.0 || xin >= w || yin < 0.0 || yin >= h) {
        o[0] = fill[0], o[1] = fill[1], o[2] = fill[2];
        continue;
      }
      xin -= 0.5;
      yin -= 0.5;
      int xi = FLOOR(xin), yi = FLOOR(yin);
      double dx = xin - xi, dy = yin - yi;
      int x0 = CLIP(xi, w) * 3, x1 = CLIP(xi + 1, w) * 3;
      const unsigned char *r0 = in + (size_t)CLIP(yi, h) * w * 3;
      const unsigned char *r1 = (yi + 1 >= 0 && yi + 1 < h) ? in + (size_t)(yi + 1) * w * 3 : r0;
      /* Where a weight is 0 (a shear's rows or columns), v + (u - v) * 0 is v: the same value
         without the work. */
      if (dy == 0.0) {
        for (int b = 0; b < 3; b++) o[b] = (unsigned char)(u8[r0[x0 + b]] + (u8[r0[x1 + b]] - u8[r0[x0 + b]]) * dx);
      } else if (dx == 0.0) {
        for (int b = 0; b < 3; b++) o[b] = (unsigned char)(u8[r0[x0 + b]] + (u8[r1[x0 + b]] - u8[r0[x0 + b]]) * dy);
      } else {
        for (int b = 0; b < 3; b++) {
          double v1 = u8[r0[x0 + b]] + (u8[r0[x1 + b]] - u8[r0[x0 + b]]) * dx;
          double v2 = u8[r1[x0 + b]] + (u8[r1[x1 + b]] - u8[r1[x0 + b]]) * dx;
          o[b] = (unsigned char)(v1 + (v2 - v1) * dy);
        }
      }
    }
  }
}

/* ImageEnhance.Sharpness(image).enhance(factor): Image.blend(smooth, image, factor), ``smooth``
   being ImageFilter.SMOOTH's 3x3 kernel (1 1 1 / 1 5 1 / 1 1 1, over 13) with the border rows and
   columns kept. Filter.c sums the weighted pixels in float and truncates the sum + 0.5; here the
   sum is an integer S and the value floor((2 S + 13) / 26), the same: (2 S + 13) / 26 lies at least
   1/26 from an integer, far beyond float's error. The blend is Blend.c's, in float; its clamp
   leaves an interpolation (factor in [0, 1]) as it is. Loops without branches, so they vectorise. */
void augment_sharpness(const unsigned char *restrict in, int w, int h, unsigned char *restrict out,
                       float factor) {
  memcpy(out, in, (size_t)w * h * 3);
  const int n = (w - 2) * 3;
  for (int y = 1; y < h - 1; y++) {
    const unsigned char *up = in + (size_t)(y - 1) * w * 3 + 3;
    const unsigned char *mid = up + (size_t)w * 3, *down = mid + (size_t)w * 3;
    unsigned char *o = out + (size_t)y * w * 3 + 3;
    for (int i = 0; i < n; i++) {
      int sum = up[i - 3] + up[i] + up[i + 3] + mid[i - 3] + 5 * mid[i] + mid[i + 3] + down[i - 3] + down[i] +
                down[i + 3];
      int smooth = (int)((float)(2 * sum + 13) * (1.0f / 26.0f));
      int v = (int)(float)(smooth + factor * (mid[i] - smooth)); /* as in augment_color */
      o[i] = v < 0 ? 0 : v > 255 ? 255 : v;
    }
  }
}

/* Image.blend of the constant ``base`` and each value 0..255 by ``alpha``: Blend.c's arithmetic, in
   float, clamped (which leaves an interpolation as it is). ImageEnhance's Brightness (base 0)
   and Contrast (base the grey image's mean) as a lookup table. */
void augment_blend_lut(int base, float alpha, unsigned char *lut) {
  for (int v = 0; v < 256; v++) {
    float t = (float)(base + alpha * (v - base));
    lut[v] = t <= 0.0f ? 0 : t >= 255.0f ? 255 : (unsigned char)t;
  }
}

/* Image.point with a table of 3 x 256 (one per band), on n packed RGB pixels. */
void augment_lut(const unsigned char *restrict in, int n, unsigned char *restrict out,
                 const unsigned char *restrict lut) {
  for (int i = 0; i < n; i++) {
    out[i * 3] = lut[in[i * 3]];
    out[i * 3 + 1] = lut[256 + in[i * 3 + 1]];
    out[i * 3 + 2] = lut[512 + in[i * 3 + 2]];
  }
}

/* Pillow's RGB to L (Convert.c: ITU-R 601-2 luma in 16-bit fixed point, rounded). */
#define LUMA(p) (((p)[0] * 19595 + (p)[1] * 38470 + (p)[2] * 7471 + 0x8000) >> 16)

/* Image.histogram: 3 x 256 counts of n packed RGB pixels; with ``luma``, then the 256 of their luma
   (convert("L").histogram()) instead. */
void augment_histogram(const unsigned char *in, int n, int *counts, int luma) {
  memset(counts, 0, sizeof(int) * (luma ? 256 : 768));
  if (luma) {
    for (int i = 0; i < n; i++) counts[LUMA(in + (size_t)i * 3)]++;
    return;
  }
  for (int i = 0; i < n; i++) counts[in[i * 3]]++, counts[256 + in[i * 3 + 1]]++, counts[512 + in[i * 3 + 2]]++;
}

/* ImageEnhance.Color(image).enhance(alpha): Image.blend(image.convert("L").convert("RGB"), image,
   alpha), each band with its pixel's luma. */
void augment_color(const unsigned char *restrict in, int n, unsigned char *restrict out, float alpha) {
  for (int i = 0; i < n; i++) {
    const unsigned char *p = in + (size_t)i * 3;
    int luma = LUMA(p);
    for (int b = 0; b < 3; b++) {
      /* Blend.c clamps the float; truncating first and clamping the integer gives the same byte
         (a value in (-1, 0) truncates to 0) without branches, which random pixels mispredict. */
      int v = (int)(float)(luma + alpha * (p[b] - luma));
      out[i * 3 + b] = v < 0 ? 0 : v > 255 ? 255 : v;
    }
  }
}

#ifndef JPEGCROP_TAG
#define JPEGCROP_TAG "" /* set by setup.py: the source's hash, as jpegcrop.py names its own builds */
#endif
const char *jpegcrop_tag(void) { return JPEGCROP_TAG; }
