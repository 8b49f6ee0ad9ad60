/* Decode only the part of a JPEG that a crop keeps (used by jpegcrop.py, which builds this file at
   pip install time or on first use: cc -O3 -shared -fPIC jpegcrop.c -ljpeg).

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

#ifndef JPEGCROP_TAG
#define JPEGCROP_TAG "" /* set by setup.py: the source's hash, as jpegcrop.py names its own builds */
#endif
const char *jpegcrop_tag(void) { return JPEGCROP_TAG; }
