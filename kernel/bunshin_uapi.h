/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * Userspace interface of /dev/bunshin: copy-on-write sharing of anonymous memory
 * between a snapshot (a held mm) and another process, through the kernel's own
 * fork path (anon_vma_fork + copy_page_range).
 */
#ifndef BUNSHIN_UAPI_H
#define BUNSHIN_UAPI_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define BUNSHIN_IOC_MAGIC 0xB5

/* bunshin_share_req.flags: discard whatever the target's VMA already holds (pages, anon_vma)
 * instead of refusing with EBUSY. For clones restored by CRIU, whose anonymous memory is by
 * construction the snapshot's, and which CRIU's restorer may have touched. */
#define BUNSHIN_SHARE_RESET 1u
/* bunshin_share_req.flags: also share the private pages (written, hence anonymous) of private
 * file mappings, where the target maps the same inode at the same offset. A clone restored
 * over the same lower layer maps its libraries that way; a file it sees as another inode
 * (an upper-layer copy, a ghost file) is skipped, and keeps what CRIU restored there. */
#define BUNSHIN_SHARE_FILES 2u
#define BUNSHIN_SHARE_FLAGS (BUNSHIN_SHARE_RESET | BUNSHIN_SHARE_FILES)

/* Take a reference on the mm of `pid` (a stopped holder, e.g. an injected fork
 * child) and return it as a snapshot descriptor. pread() on it reads the
 * snapshot's memory at offset == virtual address. */
struct bunshin_snapshot_req {
	__s32 pid;
	__u32 flags;
};

/* Map every anonymous private VMA of the snapshot that lies in [start, end) (and, with
 * BUNSHIN_SHARE_FILES, every private file VMA holding written pages) copy-on-write into
 * the VMA at the same addresses of `target_pid` (0: caller). The source is `snap_fd`
 * or, when it is -1, the mm of the stopped `holder_pid`. */
struct bunshin_share_req {
	__s32 snap_fd;
	__s32 holder_pid;
	__s32 target_pid;
	__u32 flags;
	__u64 start;
	__u64 end;
	__u64 vmas;   /* out: VMAs shared */
	__u64 skipped; /* out: VMAs in range left alone (shared mappings, other files, ...) */
};

/* Pages mapped by the snapshot, and how many of them only the snapshot maps now
 * (mapcount 1): what keeping the snapshot costs. */
struct bunshin_stats_req {
	__s32 snap_fd;
	__u32 flags;
	__u64 pages;
	__u64 private_pages;
};

#define BUNSHIN_IOC_SNAPSHOT _IOW(BUNSHIN_IOC_MAGIC, 1, struct bunshin_snapshot_req)
#define BUNSHIN_IOC_SHARE _IOWR(BUNSHIN_IOC_MAGIC, 2, struct bunshin_share_req)
#define BUNSHIN_IOC_STATS _IOWR(BUNSHIN_IOC_MAGIC, 3, struct bunshin_stats_req)

#endif
