/* Declarations shared by the CFFI cdef and native.c. Keep this file cdef-parsable:
 * no preprocessor logic, no includes. */

struct bn_spawn_cfg {
	int ns_flags;            /* CLONE_NEW* flags for the workspace */
	const char *root;        /* host path where the root overlay is mounted (inside the child's mntns;
	                            with CLONE_NEWUSER, already there before the clone) */
	const char *overlay_opts;/* lowerdir=...,upperdir=...,workdir=... */
	const char *hostname;
	const char *init_path;   /* path of the init inside the new root */
	int mount_sysfs;
	int ksm_merge;           /* prctl(PR_SET_MEMORY_MERGE) before exec, inherited by every descendant */
	int privileged;          /* keep every capability and an unmasked /proc */
	const unsigned char *seccomp_bpf; /* struct sock_filter[] loaded just before exec, or NULL */
	int seccomp_len;         /* its length in bytes */
	unsigned long long tmpfs_size; /* size= of /tmp and /dev/shm in bytes (0: tmpfs's defaults) */
};

/* Clone the workspace's first process. It blocks until bn_spawn_release() is
 * called, so the caller can place it in its cgroups before it does anything.
 * Returns the host pid, or -1 with errno; *pidfd, *sync_fd and *err_fd are set. */
int bn_spawn(const struct bn_spawn_cfg *cfg, int *pidfd, int *sync_fd, int *err_fd);

/* Let the child continue and wait until it has exec'd the init (returns 0) or
 * failed (returns -1, err holds "step: strerror"). Closes both fds. */
int bn_spawn_release(int sync_fd, int err_fd, char *err, int errlen);

/* openat2(2): RESOLVE_IN_ROOT keeps absolute symlinks and ".." inside the workspace's root. */
int bn_openat2(int dirfd, const char *path, int flags, int mode, unsigned long long resolve);
int bn_setns(int fd, int nstype);
int bn_mount(const char *source, const char *target, const char *fstype, unsigned long flags, const char *data);
int bn_umount2(const char *target, int flags);
int bn_prctl(int option, unsigned long a2, unsigned long a3, unsigned long a4, unsigned long a5);
int bn_set_hostname_in(int pid, const char *name);
/* Bring up the loopback interface of `pid`'s network namespace. */
int bn_loopback_up_in(int pid);

/* Attach a device allowlist to the cgroup2 directory cgroup_fd: n (type, major, minor) triples,
 * type 1 block or 2 char, minor -1 for any (native.c). 0, or -1 with errno. */
int bn_attach_device_filter(int cgroup_fd, const int *rules, int n);

/* ptrace syscall injection (csrc/inject.c). Negative returns are -errno. */
int bn_ptrace_seize(int pid);
/* timeout_ms: give up with -ETIMEDOUT past it (0: no deadline). */
int bn_ptrace_wait_stop(int pid, int timeout_ms);
int bn_ptrace_detach(int pid);
/* Inject clone(exit signal 0) into stopped tracee `pid`; returns the new, traced and
 * stopped child's pid on the host, and its pid in the tracee's namespace in *ns_child.
 * Past timeout_ms the tracee is interrupted, restored, and -ETIMEDOUT returned. */
int bn_inject_fork(int pid, int *ns_child, int timeout_ms);
/* Inject wait4(ns_child, NULL, __WALL | WNOHANG, NULL) into stopped tracee `parent`; ns_child
 * is the child's pid as the parent sees it. -EAGAIN: not reapable yet. */
int bn_inject_reap(int parent, int ns_child, int timeout_ms);
/* Any syscall with up to three arguments; its return value (or -errno) in *result.
 * Returns -ETIMEDOUT when it ran past timeout_ms (the tracee was interrupted and restored). */
int bn_inject_syscall(int pid, long nr, long a1, long a2, long a3, int timeout_ms, long *result);

/* Page comparison for incremental snapshot images (csrc/pages.c). Compares n pages of
 * `page` bytes at a and b; out[i] is 1 where page i is equal, else 0. Returns how many
 * are equal. */
size_t bn_pages_equal(const unsigned char *a, const unsigned char *b, size_t n, size_t page, unsigned char *out);

/* Runs of pages to dump in a pagemap slice (csrc/pages.c): present or swapped, not the zero
 * page; (first page, count) pairs into runs, at most max_runs; returns how many. */
size_t bn_pagemap_runs(const uint64_t *pm, size_t n, uint64_t zero_pfn, uint64_t *runs, size_t max_runs);
