/* Pages of snapshot images: a dump's pages compared with those its parent snapshot stored at
 * the same addresses (bunshinfork/process/pages.py), and the runs of pages a dump writes, read
 * from a process's pagemap (bunshinfork/memory/late.py). */
#include <stddef.h>
#include <stdint.h>
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

/* The pages a dump writes from a slice of /proc/PID/pagemap (n entries, the first at page 0):
 * present or swapped, and not the shared zero page (CRIU skips it too). Writes (first page,
 * count) pairs to runs, at most max_runs of them, and returns how many; a slice alternates at
 * worst, so n / 2 + 1 pairs always suffice (bunshinfork/memory/late.py). */
size_t bn_pagemap_runs(const uint64_t *pm, size_t n, uint64_t zero_pfn, uint64_t *runs, size_t max_runs)
{
	const uint64_t present = 1ULL << 63, swapped = 1ULL << 62, pfn_mask = (1ULL << 55) - 1;
	size_t nr = 0;
	int open = 0;

	for (size_t i = 0; i < n; i++) {
		uint64_t e = pm[i];
		int dump = (e & swapped) || ((e & present) && (e & pfn_mask) != zero_pfn);

		if (dump && open) {
			runs[2 * (nr - 1) + 1]++;
		} else if (dump) {
			if (nr == max_runs)
				return nr;
			runs[2 * nr] = i;
			runs[2 * nr + 1] = 1;
			nr++;
			open = 1;
		} else {
			open = 0;
		}
	}
	return nr;
}
