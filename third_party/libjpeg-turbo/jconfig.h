/* jconfig.h for the libjpeg API of ABI 62 (libjpeg-turbo's default build, the one Pillow's wheels bundle as
 * libjpeg.so.62), written from libjpeg-turbo 3.2.0's src/jconfig.h.in for
 * datamodules/sample/region_libjpeg.c, which only decodes. */

#ifndef JPEG_LIB_VERSION
#define JPEG_LIB_VERSION  62
#endif

#define LIBJPEG_TURBO_VERSION  3.2.0
#define LIBJPEG_TURBO_VERSION_NUMBER  3002000

#define MEM_SRCDST_SUPPORTED  1

#ifndef BITS_IN_JSAMPLE
#define BITS_IN_JSAMPLE  8
#endif

#ifdef _WIN32
#ifndef __RPCNDR_H__
typedef unsigned char boolean;
#endif
#define HAVE_BOOLEAN
#if !(defined(_BASETSD_H_) || defined(_BASETSD_H))
typedef short INT16;
typedef signed int INT32;
#endif
#define XMD_H
#endif
