// SPDX-License-Identifier: GPL-2.0
/*
 * bunshin: share a snapshot's private memory copy-on-write with another process.
 *
 * A snapshot is an mm kept alive by a descriptor: the mm of a holder, a child that an
 * orchestrator forked (through ptrace injection) out of a frozen workspace process.
 * BUNSHIN_IOC_SHARE then makes a target's VMAs at the same addresses map the snapshot's
 * private pages (anonymous VMAs, and the written pages of private file VMAs that map the
 * same inode in both) copy-on-write, with exactly the kernel's fork path (anon_vma_fork, then
 * copy_page_range, then a TLB flush of the source mm), so reclaim, migration,
 * compaction and THP see ordinary forked pages.
 *
 * anon_vma_fork, copy_page_range, split_vma, walk_page_range, access_remote_vm and
 * flush_tlb_mm_range are not exported: they are resolved through kallsyms (found with
 * the kprobe trick), and typed with typeof(&fn) so that signature drift between kernel
 * versions is a build error, not a crash.
 */
#include <linux/anon_inodes.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/kprobes.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/mmap_lock.h>
#include <linux/module.h>
#include <linux/pagewalk.h>
#include <linux/rmap.h>
#include <linux/sched/mm.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/version.h>
#include <asm/tlbflush.h>

#include "bunshin_uapi.h"

#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 2, 0)
#define BUNSHIN_VMA_ITER_SPLIT 1 /* split_vma() takes a vma iterator */
#endif
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 3, 0)
#define BUNSHIN_VM_FLAGS_API 1 /* vm_flags is const: vm_flags_set/clear */
#endif
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 4, 0)
#define BUNSHIN_PER_VMA_LOCK 1 /* vma_start_write before modifying a VMA */
#endif
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 7, 0)
/* 6.7 moved split_vma() into mm/internal.h (later mm/vma.h), out of a module's reach. This
 * copy of its prototype is the one place where signature drift is not a build error: check
 * it against mm/vma.h when adding a kernel version. */
int split_vma(struct vma_iterator *vmi, struct vm_area_struct *vma, unsigned long addr, int new_below);
#endif
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 12, 0)
/* 6.12 dropped page_mapcount(); for the anonymous pages counted here (small, or a THP mapped
 * whole by one PMD) the folio's mapcount is the same number. */
#define bunshin_mapcount(page) folio_mapcount(page_folio(page))
#else
#define bunshin_mapcount(page) page_mapcount(page)
#endif
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 3, 0)
#define bunshin_zap(vma, start, size) zap_page_range_single(vma, start, size, NULL)
#else
#define bunshin_zap(vma, start, size) zap_page_range(vma, start, size)
#endif
#ifndef fd_file
#define fd_file(f) ((f).file) /* 6.12 made struct fd opaque behind fd_file() */
#endif

#ifndef flush_tlb_mm
/* asm/tlbflush.h hides this prototype from modules (#ifndef MODULE); it is the one that
 * flush_tlb_mm() expands to, unchanged on x86 from 4.19 to 6.12. */
extern void flush_tlb_mm_range(struct mm_struct *mm, unsigned long start, unsigned long end,
			       unsigned int stride_shift, bool freed_tables);
#endif
/* After that prototype: asm/tlb.h's tlb_flush() calls flush_tlb_mm_range(). Only the struct
 * mmu_gather layout is used here; the calls go through kallsyms-resolved pointers. */
#include <asm/tlb.h>

static typeof(&anon_vma_fork) p_anon_vma_fork;
static typeof(&copy_page_range) p_copy_page_range;
static typeof(&split_vma) p_split_vma;
static typeof(&walk_page_range) p_walk_page_range;
static typeof(&access_remote_vm) p_access_remote_vm;
static typeof(&unlink_anon_vmas) p_unlink_anon_vmas;
static typeof(&flush_tlb_mm_range) p_flush_tlb_mm_range;
static typeof(&free_pgd_range) p_free_pgd_range;
static typeof(&tlb_gather_mmu) p_tlb_gather_mmu;
static typeof(&tlb_finish_mmu) p_tlb_finish_mmu;

static unsigned long lookup_name(const char *name)
{
	static unsigned long (*kln)(const char *name);

	if (!kln) {
		struct kprobe kp = { .symbol_name = "kallsyms_lookup_name" };

		if (register_kprobe(&kp) < 0)
			return 0;
		kln = (void *)kp.addr;
		unregister_kprobe(&kp);
	}
	return kln ? kln(name) : 0;
}

#define RESOLVE(var, name)                                              \
	do {                                                            \
		var = (typeof(var))lookup_name(name);                   \
		if (!var) {                                             \
			pr_err("bunshin: cannot resolve %s\n", name);   \
			return -ENOENT;                                 \
		}                                                       \
	} while (0)

static int resolve_symbols(void)
{
	RESOLVE(p_anon_vma_fork, "anon_vma_fork");
	RESOLVE(p_copy_page_range, "copy_page_range");
	RESOLVE(p_split_vma, "split_vma");
	RESOLVE(p_walk_page_range, "walk_page_range");
	RESOLVE(p_access_remote_vm, "access_remote_vm");
	RESOLVE(p_unlink_anon_vmas, "unlink_anon_vmas");
	RESOLVE(p_flush_tlb_mm_range, "flush_tlb_mm_range");
	RESOLVE(p_free_pgd_range, "free_pgd_range");
	RESOLVE(p_tlb_gather_mmu, "tlb_gather_mmu");
	RESOLVE(p_tlb_finish_mmu, "tlb_finish_mmu");
	return 0;
}

/* ---- snapshot descriptors ---- */

static int snap_release(struct inode *inode, struct file *file)
{
	mmput(file->private_data);
	return 0;
}

static ssize_t snap_read(struct file *file, char __user *buf, size_t count, loff_t *ppos)
{
	struct mm_struct *mm = file->private_data;
	unsigned long addr = (unsigned long)*ppos;
	ssize_t done = 0;
	char *page;

	if (*ppos < 0)
		return -EINVAL;
	page = (char *)__get_free_page(GFP_KERNEL);
	if (!page)
		return -ENOMEM;
	while (count) {
		int chunk = min_t(size_t, count, PAGE_SIZE - offset_in_page(addr));
		int n = p_access_remote_vm(mm, addr, page, chunk, FOLL_FORCE);

		if (n <= 0) {
			if (!done)
				done = -EIO;
			break;
		}
		if (copy_to_user(buf + done, page, n)) {
			done = -EFAULT;
			break;
		}
		done += n;
		addr += n;
		count -= n;
		if (n < chunk)
			break;
	}
	free_page((unsigned long)page);
	if (done > 0)
		*ppos = addr;
	return done;
}

struct stats_walk {
	u64 pages;
	u64 private_pages;
};

static int stats_pmd(pmd_t *pmd, unsigned long addr, unsigned long next, struct mm_walk *walk)
{
	struct stats_walk *st = walk->private;
	pmd_t val = READ_ONCE(*pmd);

	if (pmd_trans_huge(val) && pmd_present(val)) {
		struct page *page = pmd_page(val);
		u64 n = (next - addr) >> PAGE_SHIFT;

		st->pages += n;
		if (bunshin_mapcount(page) == 1)
			st->private_pages += n;
		/* Counted as a whole: do not let the walker split the huge page. */
		walk->action = ACTION_CONTINUE;
	}
	return 0;
}

static int stats_pte(pte_t *pte, unsigned long addr, unsigned long next, struct mm_walk *walk)
{
	struct stats_walk *st = walk->private;
	pte_t val = READ_ONCE(*pte);
	struct page *page;

	if (!pte_present(val) || is_zero_pfn(pte_pfn(val)) || !pfn_valid(pte_pfn(val)))
		return 0;
	page = pte_page(val);
	if (!PageAnon(page))
		return 0;
	st->pages++;
	if (bunshin_mapcount(page) == 1)
		st->private_pages++;
	return 0;
}

static const struct mm_walk_ops stats_ops = {
	.pmd_entry = stats_pmd,
	.pte_entry = stats_pte,
};

static long snap_stats(struct mm_struct *mm, struct bunshin_stats_req *req)
{
	struct stats_walk st = { 0 };
	int ret;

	mmap_read_lock(mm);
	ret = p_walk_page_range(mm, 0, TASK_SIZE, &stats_ops, &st);
	mmap_read_unlock(mm);
	req->pages = st.pages;
	req->private_pages = st.private_pages;
	return ret;
}

static const struct file_operations snap_fops = {
	.owner = THIS_MODULE,
	.release = snap_release,
	.read = snap_read,
	.llseek = default_llseek,
};

static struct task_struct *task_of(pid_t pid)
{
	struct task_struct *t;

	if (pid == 0) {
		get_task_struct(current);
		return current;
	}
	rcu_read_lock();
	t = get_pid_task(find_vpid(pid), PIDTYPE_PID);
	rcu_read_unlock();
	return t;
}

/* A held mm must not change under us: the holder is stopped (ptrace or SIGSTOP). */
static bool task_quiescent(struct task_struct *t)
{
	return t == current || task_is_stopped_or_traced(t);
}

static long do_snapshot(struct bunshin_snapshot_req *req)
{
	struct task_struct *t = task_of(req->pid);
	struct mm_struct *mm;
	struct file *file;
	int fd;

	if (!t)
		return -ESRCH;
	if (!task_quiescent(t)) {
		put_task_struct(t);
		return -EBUSY;
	}
	mm = get_task_mm(t);
	put_task_struct(t);
	if (!mm)
		return -EINVAL;
	fd = get_unused_fd_flags(O_CLOEXEC);
	if (fd < 0) {
		mmput(mm);
		return fd;
	}
	file = anon_inode_getfile("[bunshin-snapshot]", &snap_fops, mm, O_RDONLY);
	if (IS_ERR(file)) {
		put_unused_fd(fd);
		mmput(mm);
		return PTR_ERR(file);
	}
	/* pread() at a virtual address: offsets are addresses, not a stream position. */
	file->f_mode |= FMODE_PREAD | FMODE_LSEEK;
	fd_install(fd, file);
	return fd;
}

/* ---- sharing ---- */

static int split_at(struct mm_struct *mm, struct vm_area_struct *vma, unsigned long addr, int new_below)
{
#ifdef BUNSHIN_VMA_ITER_SPLIT
	VMA_ITERATOR(vmi, mm, addr);

	vma_iter_set(&vmi, vma->vm_start);
	return p_split_vma(&vmi, vma, addr, new_below);
#else
	return p_split_vma(mm, vma, addr, new_below);
#endif
}

static void copy_thp_advice(struct vm_area_struct *dst, struct vm_area_struct *src)
{
	unsigned long bits = src->vm_flags & (VM_HUGEPAGE | VM_NOHUGEPAGE);
#ifdef BUNSHIN_VM_FLAGS_API
	vm_flags_mod(dst, bits, (VM_HUGEPAGE | VM_NOHUGEPAGE) & ~bits);
#else
	dst->vm_flags = (dst->vm_flags & ~(VM_HUGEPAGE | VM_NOHUGEPAGE)) | bits;
#endif
}

/*
 * fork() copies into a new mm, whose page tables are all empty. A restored clone's range can
 * still hold page tables: empty ones left by CRIU's restorer or by the reset, or ones mapping
 * the zero page. copy_huge_pmd() would overwrite a PMD that points at such a table, leaking
 * the table and its pgtables_bytes ("BUG: non-zero pgtables_bytes on freeing mm"). So empty
 * the range and free the page tables that lie wholly inside it, as munmap would. Tables that
 * also span a neighbour stay; a huge PMD never shares its 2 MiB with a neighbour.
 */
static void clear_tables(struct vm_area_struct *dst)
{
	struct mmu_gather tlb;

	bunshin_zap(dst, dst->vm_start, dst->vm_end - dst->vm_start);
	p_tlb_gather_mmu(&tlb, dst->vm_mm);
	p_free_pgd_range(&tlb, dst->vm_start, dst->vm_end, dst->vm_start, dst->vm_end);
	p_tlb_finish_mmu(&tlb);
}

/* A private file mapping whose written pages fork() would copy: it has an anon_vma. Device
 * and hugetlb mappings keep CRIU's path; DONTCOPY ones are absent in a fork child. */
static bool file_private_written(struct vm_area_struct *vma)
{
	return vma->vm_file && vma->anon_vma &&
	       !(vma->vm_flags & (VM_SHARED | VM_IO | VM_PFNMAP | VM_MIXEDMAP | VM_HUGETLB | VM_DONTCOPY));
}

/*
 * A target VMA can take src's pages only if it is the same kind of mapping. For a file
 * mapping that means the same inode at the same offset: copy_page_range also copies the
 * page-cache pages src maps, which would be wrong data under another file. (On overlayfs
 * both map the real file, so a lower-layer file is one inode in the source and its clones.)
 */
static int same_mapping(struct vm_area_struct *dst, struct vm_area_struct *src)
{
	if (dst->vm_flags & VM_SHARED)
		return -EINVAL;
	if (!src->vm_file)
		return vma_is_anonymous(dst) ? 0 : -EINVAL;
	if (!dst->vm_file || file_inode(dst->vm_file) != file_inode(src->vm_file) ||
	    dst->vm_pgoff + ((src->vm_start - dst->vm_start) >> PAGE_SHIFT) != src->vm_pgoff)
		return -EXDEV;
	return 0;
}

/*
 * Make dst's VMA at [src->vm_start, src->vm_end) pristine and exactly aligned to src,
 * then fork src's pages into it. Both mmap locks are held for writing. -EXDEV: the
 * target maps another file there; it is left untouched.
 */
static int share_vma(struct mm_struct *dst_mm, struct vm_area_struct *src, u32 flags)
{
	struct vm_area_struct *dst = find_vma(dst_mm, src->vm_start);
	int ret;

	if (!dst || dst->vm_start > src->vm_start || dst->vm_end < src->vm_end)
		return -ENOENT; /* the target has no mapping covering the snapshot's VMA */
	/* Before any reset: a VMA that cannot take src's pages keeps what it has. */
	ret = same_mapping(dst, src);
	if (ret)
		return ret;
	if ((flags & BUNSHIN_SHARE_RESET) && (dst->anon_vma || !list_empty(&dst->anon_vma_chain))) {
		/* The caller declared the target's content disposable: drop its pages, then its
		 * anon_vma links, which leaves the VMA as a fresh mmap would. */
		bunshin_zap(dst, dst->vm_start, dst->vm_end - dst->vm_start);
		p_unlink_anon_vmas(dst);
	}
	/* Pages or an anon_vma already there would be silently mixed with the snapshot's. */
	if (dst->anon_vma || !list_empty(&dst->anon_vma_chain)) {
		pr_info_ratelimited("bunshin: target VMA %lx-%lx is not pristine (has an anon_vma)\n",
				    dst->vm_start, dst->vm_end);
		return -EBUSY;
	}
	/* The target's mapping may have merged with untouched neighbours: cut it to size. */
	if (dst->vm_start < src->vm_start) {
		ret = split_at(dst_mm, dst, src->vm_start, 1);
		if (ret)
			return ret;
		dst = find_vma(dst_mm, src->vm_start);
	}
	if (dst->vm_end > src->vm_end) {
		ret = split_at(dst_mm, dst, src->vm_end, 0);
		if (ret)
			return ret;
		dst = find_vma(dst_mm, src->vm_start);
	}
	if (!dst || dst->vm_start != src->vm_start || dst->vm_end != src->vm_end)
		return -EBUSY;
#ifdef BUNSHIN_PER_VMA_LOCK
	vma_start_write(dst);
	vma_start_write(src);
#endif
	clear_tables(dst);
	/* rmap finds dst's copy of an anonymous page through page->index and dst->vm_pgoff;
	 * without this, migration, compaction and reclaim would silently miss the target. (A
	 * file VMA's vm_pgoff is its file offset, already equal.) */
	if (!src->vm_file)
		dst->vm_pgoff = src->vm_pgoff;
	copy_thp_advice(dst, src);
	ret = p_anon_vma_fork(dst, src);
	if (ret)
		return ret;
	return p_copy_page_range(dst, src);
}

static void lock_two(struct mm_struct *a, struct mm_struct *b)
{
	/* A fixed order (by address) so that two concurrent shares cannot deadlock. */
	if (a > b)
		swap(a, b);
	mmap_write_lock(a);
	mmap_write_lock_nested(b, SINGLE_DEPTH_NESTING);
}

static void unlock_two(struct mm_struct *a, struct mm_struct *b)
{
	mmap_write_unlock(a);
	mmap_write_unlock(b);
}

static long do_share(struct bunshin_share_req *req)
{
	struct mm_struct *src_mm = NULL, *dst_mm = NULL;
	struct task_struct *target;
	struct vm_area_struct *src;
	long ret = 0;

	if (req->start >= req->end || !PAGE_ALIGNED(req->start) || !PAGE_ALIGNED(req->end) ||
	    (req->flags & ~BUNSHIN_SHARE_FLAGS))
		return -EINVAL;
	if (req->snap_fd >= 0) {
		struct fd f = fdget(req->snap_fd);

		if (!fd_file(f))
			return -EBADF;
		if (fd_file(f)->f_op != &snap_fops) {
			fdput(f);
			return -EINVAL;
		}
		src_mm = fd_file(f)->private_data;
		mmget(src_mm);
		fdput(f);
	} else {
		struct task_struct *holder = task_of(req->holder_pid);

		if (!holder)
			return -ESRCH;
		if (holder == current || !task_quiescent(holder)) {
			put_task_struct(holder);
			return -EBUSY;
		}
		src_mm = get_task_mm(holder);
		put_task_struct(holder);
		if (!src_mm)
			return -EINVAL;
	}
	target = task_of(req->target_pid);
	if (!target) {
		ret = -ESRCH;
		goto out;
	}
	if (!task_quiescent(target)) {
		pr_info_ratelimited("bunshin: target %d is running; stop it first\n", req->target_pid);
		put_task_struct(target);
		ret = -EBUSY; /* a running target could fault the range in while we map it */
		goto out;
	}
	dst_mm = get_task_mm(target);
	put_task_struct(target);
	if (!dst_mm || dst_mm == src_mm) {
		ret = -EINVAL;
		goto out;
	}

	req->vmas = 0;
	req->skipped = 0;
	lock_two(src_mm, dst_mm);
	{
		VMA_ITERATOR(vmi, src_mm, req->start);

		for_each_vma_range(vmi, src, req->end) {
			bool anon = vma_is_anonymous(src) &&
				    !(src->vm_flags & (VM_SHARED | VM_DONTCOPY | VM_WIPEONFORK));
			bool file = (req->flags & BUNSHIN_SHARE_FILES) && file_private_written(src);

			if (!anon && !file) {
				/* fork() gives these nothing either: DONTCOPY is absent in a child and
				 * WIPEONFORK starts empty. Shared mappings, and file mappings without
				 * written pages, keep CRIU's path. */
				req->skipped++;
				continue;
			}
			if (src->vm_start < req->start || src->vm_end > req->end) {
				ret = -ERANGE; /* ranges cover whole VMAs, as /proc/PID/maps lists them */
				break;
			}
			ret = share_vma(dst_mm, src, req->flags);
			if (file && ret == -EXDEV) {
				/* Another inode in the target (an upper-layer copy, a ghost file): its
				 * pages stay those CRIU restored. */
				req->skipped++;
				ret = 0;
				continue;
			}
			if (ret)
				break;
			req->vmas++;
		}
	}
	/* copy_page_range write-protected the source's PTEs: stale writable TLB entries
	 * would let the snapshot's writer skip the copy-on-write fault. */
	p_flush_tlb_mm_range(src_mm, 0UL, TLB_FLUSH_ALL, 0UL, true);
	unlock_two(src_mm, dst_mm);
out:
	if (dst_mm)
		mmput(dst_mm);
	mmput(src_mm);
	return ret;
}

static long bunshin_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	void __user *uarg = (void __user *)arg;
	long ret;

	if (!capable(CAP_SYS_ADMIN))
		return -EPERM;
	switch (cmd) {
	case BUNSHIN_IOC_SNAPSHOT: {
		struct bunshin_snapshot_req req;

		if (copy_from_user(&req, uarg, sizeof(req)))
			return -EFAULT;
		return do_snapshot(&req);
	}
	case BUNSHIN_IOC_SHARE: {
		struct bunshin_share_req req;

		if (copy_from_user(&req, uarg, sizeof(req)))
			return -EFAULT;
		ret = do_share(&req);
		if (copy_to_user(uarg, &req, sizeof(req)))
			return -EFAULT;
		return ret;
	}
	case BUNSHIN_IOC_STATS: {
		struct bunshin_stats_req req;
		struct fd f;

		if (copy_from_user(&req, uarg, sizeof(req)))
			return -EFAULT;
		f = fdget(req.snap_fd);
		if (!fd_file(f))
			return -EBADF;
		if (fd_file(f)->f_op != &snap_fops) {
			fdput(f);
			return -EINVAL;
		}
		ret = snap_stats(fd_file(f)->private_data, &req);
		fdput(f);
		if (!ret && copy_to_user(uarg, &req, sizeof(req)))
			return -EFAULT;
		return ret;
	}
	}
	return -ENOTTY;
}

static const struct file_operations bunshin_fops = {
	.owner = THIS_MODULE,
	.unlocked_ioctl = bunshin_ioctl,
	.compat_ioctl = bunshin_ioctl,
};

static struct miscdevice bunshin_dev = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "bunshin",
	.fops = &bunshin_fops,
	.mode = 0600,
};

static int __init bunshin_init(void)
{
	int ret;

#ifdef CONFIG_CFI_CLANG
	pr_err("bunshin: refusing to load: kCFI traps indirect calls to kallsyms-resolved functions\n");
	return -EOPNOTSUPP;
#endif
#if defined(CONFIG_X86_KERNEL_IBT)
	if (cpu_feature_enabled(X86_FEATURE_IBT)) {
		pr_err("bunshin: refusing to load: IBT seals the non-exported functions it calls\n");
		return -EOPNOTSUPP;
	}
#endif
	ret = resolve_symbols();
	if (ret)
		return ret;
	ret = misc_register(&bunshin_dev);
	if (!ret)
		pr_info("bunshin: /dev/bunshin ready\n");
	return ret;
}

static void __exit bunshin_exit(void)
{
	misc_deregister(&bunshin_dev);
}

module_init(bunshin_init);
module_exit(bunshin_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("Copy-on-write sharing of anonymous memory between workspace forks");
