/* Page comparison for incremental snapshot images: a dump's pages against those its parent
 * snapshot stored at the same addresses (bunshinfork/process/pages.py). */
#include <stddef.h>
#include <string.h>

#include "native.h"

size_t bn_pages_equal(const unsigned char *a, const unsigned char *b, size_t n, size_t page, unsigned char *out)
{
	size_t same = 0;

	for (size_t i = 0; i < n; i++) {
		out[i] = memcmp(a + i * page, b + i * page, page) == 0;
		same += out[i];
	}
	return same;
}
