/* The rows top..bottom-1 and columns left..right-1 of a JPEG, RGB, with the full decode's pixels, straight into the
 * caller's buffer (datamodules/sample/region_libjpeg.py builds this file and calls it through ctypes).
 *
 * libjpeg-turbo with torchvision's and PIL's settings (islow IDCT, fancy upsampling). jpeg_crop_scanline starts the
 * rows at an iMCU boundary; one column more on each inner side than the region (as nvImageCodec's
 * extensions/libjpeg_turbo/jpeg_mem.cpp does) gives the chroma upsampling at the region's edges the neighbours it has
 * in the whole image; jpeg_skip_scanlines keeps the rows the vertical upsampling reads. The caller grows a box
 * narrower than one MCU to the MCU grid (region.py, `region_of`).
 *
 * Any error or warning (a corrupt or truncated stream: libjpeg-turbo warns and goes on) returns a nonzero status
 * and the caller decodes the file whole, which decodes it or names the error: libjpeg's own handler would end the
 * process, so this one jumps back here (libjpeg.txt, "Error handling"). */
#include <setjmp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "jpeglib.h"

struct failure {
  struct jpeg_error_mgr manager;
  jmp_buf back;
};

static void fail(j_common_ptr cinfo) { longjmp(((struct failure *)cinfo->err)->back, 1); }

static void warn(j_common_ptr cinfo, int level) {
  if (level < 0) fail(cinfo); /* corrupt data (trace messages, level >= 0, are only words) */
}

static void quiet(j_common_ptr cinfo) { (void)cinfo; }

/* libjpeg's errors and warnings jump back to the caller's setjmp(failure->back), and nothing is printed. */
static void catch_failures(struct jpeg_decompress_struct *cinfo, struct failure *failure) {
  cinfo->err = jpeg_std_error(&failure->manager);
  failure->manager.error_exit = fail;
  failure->manager.emit_message = warn;
  failure->manager.output_message = quiet;
}

/* 1 when this library takes a decompressor of this header's ABI (jpeg_CreateDecompress checks the version and the
 * struct's size), else 0. */
int region_probe(void) {
  struct jpeg_decompress_struct cinfo;
  struct failure failure;

  catch_failures(&cinfo, &failure);
  if (setjmp(failure.back)) {
    jpeg_destroy_decompress(&cinfo);
    return 0;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return 1;
}

/* 0: decoded; 1: refused (not a baseline or extended 8-bit JPEG of 1 or 3 components, the region is outside it,
 * or libjpeg-turbo failed or warned). `out`: (bottom - top) rows of (right - left) RGB pixels, with `margin`
 * writable bytes before and after them.
 *
 * Each row is decoded in place: libjpeg-turbo writes the decoded row (the region, the columns left of it back to
 * the iMCU boundary, and the one right of it) so that the region's pixels land where they belong. The columns on
 * the left fall on the end of the rows above, which are put back from a copy; those on the right fall on the next
 * row, decoded after. (Decoding every row into one reused row buffer and copying from it was slower.) */
int region_decode(const unsigned char *data, unsigned long size, int top, int left, int bottom, int right,
                  unsigned char *out, int margin) {
  struct jpeg_decompress_struct cinfo;
  struct failure failure;
  unsigned char kept[256];
  int status = 1;

  catch_failures(&cinfo, &failure);
  if (setjmp(failure.back)) {
    jpeg_destroy_decompress(&cinfo);
    return 1;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, size);
  jpeg_read_header(&cinfo, TRUE);
  if (cinfo.progressive_mode || cinfo.arith_code || cinfo.data_precision != 8 ||
      (cinfo.num_components != 1 && cinfo.num_components != 3) || top < 0 || left < 0 || bottom <= top ||
      right <= left || (JDIMENSION)bottom > cinfo.image_height || (JDIMENSION)right > cinfo.image_width)
    goto done;
  cinfo.out_color_space = JCS_RGB;
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.do_fancy_upsampling = TRUE;
  jpeg_start_decompress(&cinfo);

  int before = left > 0, after = (JDIMENSION)right < cinfo.output_width;
  JDIMENSION x = (JDIMENSION)(left - before), width = (JDIMENSION)(right + after - left + before);
  jpeg_crop_scanline(&cinfo, &x, &width); /* x moves left to an iMCU boundary, width grows to match */
  size_t line = (size_t)(right - left) * 3, extra_left = (size_t)(left - (int)x) * 3;
  size_t extra_right = (size_t)(x + width - (JDIMENSION)right) * 3;
  if ((int)x > left || extra_left > (size_t)margin || extra_left > sizeof(kept) || extra_right > (size_t)margin)
    goto done;
  if (top > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)top) != (JDIMENSION)top) goto done;

  for (int y = top; y < bottom; y++) {
    JSAMPROW row = out + (size_t)(y - top) * line - extra_left;
    memcpy(kept, row, extra_left);
    if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) goto done;
    memcpy(row, kept, extra_left);
  }
  status = 0;
done:
  jpeg_destroy_decompress(&cinfo); /* abandons the rest of the stream: nothing below the region is decoded */
  return status;
}
