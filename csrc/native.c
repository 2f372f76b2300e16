/*
 * Native helpers for bunshinfork: what Python's os module lacks, and the
 * child side of workspace creation, which must run between clone and exec
 * without touching the Python interpreter (the parent may be multi-threaded).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/filter.h>
#include <linux/openat2.h>
#include <linux/sched.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "native.h"

#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#endif

int bn_openat2(int dirfd, const char *path, int flags, int mode, unsigned long long resolve)
{
	struct open_how how = {.flags = (uint64_t)flags, .mode = (uint64_t)mode, .resolve = resolve};
	return (int)syscall(SYS_openat2, dirfd, path, &how, sizeof(how));
}

int bn_setns(int fd, int nstype) { return setns(fd, nstype); }
int bn_umount2(const char *target, int flags) { return umount2(target, flags); }

int bn_mount(const char *source, const char *target, const char *fstype, unsigned long flags,
	     const char *data)
{
	return mount(source, target, fstype, flags, data);
}

int bn_prctl(int option, unsigned long a2, unsigned long a3, unsigned long a4, unsigned long a5)
{
	return prctl(option, a2, a3, a4, a5);
}

/* Work inside another process's UTS or network namespace, done by a thread of our own that
 * enters it (setns changes only the calling thread's UTS and network namespaces) and ends
 * there: the calling (multi-threaded) process never changes namespace, and nothing is forked
 * (a fork of this process costs milliseconds per clone, and would run every library's atfork
 * handlers: OpenBLAS's, under numpy, deadlocked parallel forks). */
struct ns_job {
	int fd, nstype, err;
	const char *hostname; /* CLONE_NEWUTS: the name to set */
};

static int loopback_up(void)
{
	int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	struct ifreq ifr;
	if (s < 0)
		return -1;
	memset(&ifr, 0, sizeof(ifr));
	strcpy(ifr.ifr_name, "lo");
	int rc = ioctl(s, SIOCGIFFLAGS, &ifr);
	if (rc == 0) {
		ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
		rc = ioctl(s, SIOCSIFFLAGS, &ifr);
	}
	int e = errno;
	close(s);
	errno = e;
	return rc;
}

static void *ns_job_run(void *arg)
{
	struct ns_job *j = arg;
	int rc = setns(j->fd, j->nstype);
	if (rc == 0)
		rc = j->nstype == CLONE_NEWUTS ? sethostname(j->hostname, strlen(j->hostname)) : loopback_up();
	j->err = rc < 0 ? errno : 0;
	return NULL;
}

static int in_ns_of(int pid, int nstype, const char *ns, const char *hostname)
{
	char path[64];
	snprintf(path, sizeof(path), "/proc/%d/ns/%s", pid, ns);
	struct ns_job j = {.fd = open(path, O_RDONLY | O_CLOEXEC), .nstype = nstype, .hostname = hostname};
	if (j.fd < 0)
		return -1;
	pthread_t t;
	int rc = pthread_create(&t, NULL, ns_job_run, &j);
	if (rc == 0)
		rc = pthread_join(t, NULL);
	else
		j.err = rc;
	close(j.fd);
	if (j.err) {
		errno = j.err;
		return -1;
	}
	return 0;
}

int bn_set_hostname_in(int pid, const char *name) { return in_ns_of(pid, CLONE_NEWUTS, "uts", name); }
int bn_loopback_up_in(int pid) { return in_ns_of(pid, CLONE_NEWNET, "net", NULL); }

/* A cgroup's device allowlist: a BPF_PROG_TYPE_CGROUP_DEVICE program attached to the cgroup2
 * directory `cgroup_fd` (with BPF_F_ALLOW_MULTI, so that a program of a parent still runs and
 * must also agree). rules holds n (type, major, minor) triples: type BPF_DEVCG_DEV_CHAR or
 * _BLOCK, minor -1 for any. Every access (read, write, mknod) to a listed node is allowed,
 * everything else refused: the program returns 1 on the first match, 0 at its end. The kernel
 * keeps the program as long as the cgroup exists; the fds are closed here. */
#define INSN(c, d, s, o, i) ((struct bpf_insn){.code = (c), .dst_reg = (d), .src_reg = (s), .off = (o), .imm = (i)})

int bn_attach_device_filter(int cgroup_fd, const int *rules, int n)
{
	struct bpf_insn prog[8 + 6 * 64];
	int len = 0;
	if (n < 0 || n > 64) {
		errno = EINVAL;
		return -1;
	}
	/* struct bpf_cgroup_dev_ctx: u32 access_type (access << 16 | type), u32 major, u32 minor */
	prog[len++] = INSN(BPF_LDX | BPF_MEM | BPF_W, BPF_REG_2, BPF_REG_1, 0, 0);
	prog[len++] = INSN(BPF_ALU | BPF_AND | BPF_K, BPF_REG_2, 0, 0, 0xffff);
	prog[len++] = INSN(BPF_LDX | BPF_MEM | BPF_W, BPF_REG_4, BPF_REG_1, 4, 0);
	prog[len++] = INSN(BPF_LDX | BPF_MEM | BPF_W, BPF_REG_5, BPF_REG_1, 8, 0);
	for (int i = 0; i < n; i++) {
		int type = rules[3 * i], major = rules[3 * i + 1], minor = rules[3 * i + 2];
		int any = minor < 0;
		/* Each failed test jumps past the rest of this rule: to the next rule's first insn. */
		int rest = any ? 4 : 5;
		prog[len++] = INSN(BPF_JMP | BPF_JNE | BPF_K, BPF_REG_2, 0, (short)(rest - 1), type);
		prog[len++] = INSN(BPF_JMP | BPF_JNE | BPF_K, BPF_REG_4, 0, (short)(rest - 2), major);
		if (!any)
			prog[len++] = INSN(BPF_JMP | BPF_JNE | BPF_K, BPF_REG_5, 0, 2, minor);
		prog[len++] = INSN(BPF_ALU64 | BPF_MOV | BPF_K, BPF_REG_0, 0, 0, 1);
		prog[len++] = INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0);
	}
	prog[len++] = INSN(BPF_ALU64 | BPF_MOV | BPF_K, BPF_REG_0, 0, 0, 0);
	prog[len++] = INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0);

	union bpf_attr attr;
	memset(&attr, 0, sizeof(attr));
	attr.prog_type = BPF_PROG_TYPE_CGROUP_DEVICE;
	attr.insns = (uint64_t)(uintptr_t)prog;
	attr.insn_cnt = (uint32_t)len;
	attr.license = (uint64_t)(uintptr_t) "GPL";
	int prog_fd = (int)syscall(SYS_bpf, BPF_PROG_LOAD, &attr, sizeof(attr));
	if (prog_fd < 0)
		return -1;
	memset(&attr, 0, sizeof(attr));
	attr.target_fd = (uint32_t)cgroup_fd;
	attr.attach_bpf_fd = (uint32_t)prog_fd;
	attr.attach_type = BPF_CGROUP_DEVICE;
	attr.attach_flags = BPF_F_ALLOW_MULTI;
	int rc = (int)syscall(SYS_bpf, BPF_PROG_ATTACH, &attr, sizeof(attr));
	int e = errno;
	close(prog_fd);
	errno = e;
	return rc;
}

/* ---- child side of bn_spawn: raw syscalls and stack buffers only ---- */

struct step_err {
	int err;
	char step[120];
};

static void report(int fd, const char *step)
{
	struct step_err e = {.err = errno};
	snprintf(e.step, sizeof(e.step), "%s", step);
	(void)!write(fd, &e, sizeof(e));
	_exit(127);
}

static void path_in(char *buf, size_t len, const char *root, const char *rel)
{
	snprintf(buf, len, "%s/%s", root, rel);
}

static int mkdir_p1(const char *path, mode_t mode)
{
	return (mkdir(path, mode) < 0 && errno != EEXIST) ? -1 : 0;
}

static void child_mount(int efd, const char *root, const char *rel, const char *fstype,
			unsigned long flags, const char *data)
{
	char path[4096], step[160];
	path_in(path, sizeof(path), root, rel);
	snprintf(step, sizeof(step), "mkdir /%s", rel);
	if (mkdir_p1(path, 0755) < 0)
		report(efd, step);
	snprintf(step, sizeof(step), "mount %s on /%s", fstype, rel);
	if (mount(fstype, path, fstype, flags, data) < 0)
		report(efd, step);
}

static const struct {
	const char *name;
	unsigned maj, min;
} devices[] = {
	{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8},
	{"urandom", 1, 9}, {"tty", 5, 0}, {"ptmx", 5, 2},
};

/* size= of a workspace tmpfs: its disk_limit where it has one, else `dflt` (empty: tmpfs's own). */
static void tmpfs_opts(char *buf, size_t len, const struct bn_spawn_cfg *cfg, const char *dflt)
{
	if (cfg->tmpfs_size)
		snprintf(buf, len, "mode=1777,size=%llu", cfg->tmpfs_size);
	else
		snprintf(buf, len, "mode=1777%s", dflt);
}

/* In a user namespace mknod is refused: each node is the host's, bound onto an empty file (as
 * runc does), except ptmx, a link to the private devpts instance's own (the host's would open
 * the host's ptys). CRIU is told these binds are external (process/options.py). */
static void child_bind_device(int efd, const char *root, const char *name)
{
	char path[4096], host[64], step[160];
	snprintf(path, sizeof(path), "%s/dev/%s", root, name);
	snprintf(step, sizeof(step), "bind /dev/%s", name);
	if (strcmp(name, "ptmx") == 0) {
		if (symlink("pts/ptmx", path) < 0)
			report(efd, step);
		return;
	}
	snprintf(host, sizeof(host), "/dev/%s", name);
	int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
	if (fd < 0)
		report(efd, step);
	close(fd);
	if (mount(host, path, NULL, MS_BIND, NULL) < 0)
		report(efd, step);
}

static void child_setup_dev(int efd, const struct bn_spawn_cfg *cfg, const char *root)
{
	char path[4096], step[160], opts[96];
	child_mount(efd, root, "dev", "tmpfs", MS_NOSUID | MS_STRICTATIME, "mode=755,size=65536k");
	for (size_t i = 0; i < sizeof(devices) / sizeof(devices[0]); i++) {
		if (cfg->ns_flags & CLONE_NEWUSER) {
			child_bind_device(efd, root, devices[i].name);
			continue;
		}
		snprintf(path, sizeof(path), "%s/dev/%s", root, devices[i].name);
		snprintf(step, sizeof(step), "mknod /dev/%s", devices[i].name);
		if (mknod(path, S_IFCHR | 0666, makedev(devices[i].maj, devices[i].min)) < 0)
			report(efd, step);
		if (chmod(path, 0666) < 0)
			report(efd, step);
	}
	/* A private devpts instance: /dev/ptmx resolves through its sibling pts/. */
	child_mount(efd, root, "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
		    "newinstance,ptmxmode=0666,mode=0620,gid=5");
	tmpfs_opts(opts, sizeof(opts), cfg, ",size=50%");
	child_mount(efd, root, "dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, opts);
	static const char *links[][2] = {{"/proc/self/fd", "fd"}, {"/proc/self/fd/0", "stdin"},
					 {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"}};
	for (size_t i = 0; i < 4; i++) {
		snprintf(path, sizeof(path), "%s/dev/%s", root, links[i][1]);
		if (symlink(links[i][0], path) < 0)
			report(efd, "symlink /dev entries");
	}
}

static void child_loopback_up(int efd)
{
	int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	struct ifreq ifr;
	if (s < 0)
		report(efd, "socket for loopback");
	memset(&ifr, 0, sizeof(ifr));
	strcpy(ifr.ifr_name, "lo");
	if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
		report(efd, "get lo flags");
	ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
	if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
		report(efd, "bring lo up");
	close(s);
}

/* Docker's masked and read-only paths (moby's oci/defaults.go; /proc/interrupts as Docker 28
 * and Kubernetes mask it): a root process inside must not reboot the host through
 * sysrq-trigger, retune it through /proc/sys, read kernel addresses and timers, or reach
 * firmware (ACPI tables, EFI variables), sound, SCSI or power-capping (RAPL energy counters, a
 * side channel) interfaces. A masked file is a bind of /dev/null, a masked directory an empty
 * read-only tmpfs, as runc does. process/options.py names the file binds for CRIU. */
static const char *const proc_masked[] = {"kcore", "keys", "timer_list", "timer_stats", "sched_debug",
					  "latency_stats", "sysrq-trigger", "interrupts", "acpi", "scsi",
					  "asound"};
static const char *const proc_readonly[] = {"sys", "bus", "fs", "irq"};
static const char *const sys_masked[] = {"firmware", "devices/virtual/powercap"};

static void child_mask(int efd, const char *root, const char *fs, const char *name)
{
	char path[4096], null[4096], step[160];
	struct stat st;
	snprintf(path, sizeof(path), "%s/%s/%s", root, fs, name);
	if (stat(path, &st) < 0)
		return; /* not in this kernel */
	snprintf(step, sizeof(step), "mask /%s/%s", fs, name);
	snprintf(null, sizeof(null), "%s/dev/null", root);
	if (S_ISDIR(st.st_mode) ? mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
					"mode=0555") < 0
				: mount(null, path, NULL, MS_BIND, NULL) < 0)
		report(efd, step);
}

static void child_mask_proc(int efd, const char *root)
{
	char path[4096], step[160];
	for (size_t i = 0; i < sizeof(proc_masked) / sizeof(proc_masked[0]); i++)
		child_mask(efd, root, "proc", proc_masked[i]);
	for (size_t i = 0; i < sizeof(proc_readonly) / sizeof(proc_readonly[0]); i++) {
		snprintf(path, sizeof(path), "%s/proc/%s", root, proc_readonly[i]);
		if (access(path, F_OK) < 0)
			continue;
		snprintf(step, sizeof(step), "read-only /proc/%s", proc_readonly[i]);
		if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) < 0 ||
		    mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
			  NULL) < 0)
			report(efd, step);
	}
}

/* The workspace's own boot id (process/init.py writes a new one into each created workspace's
 * /.bunshin/boot_id), read-only over the host's /proc/sys/kernel/random/boot_id: a cold boot
 * gets a new one, and a clone keeps its source's, since CRIU restores this bind of a file of
 * the clone's root, whose layers carry the source's. Absent in a layer made before it: the
 * host's shows through. */
static void child_bind_boot_id(int efd, const char *root)
{
	char src[4096], dst[4096];
	path_in(src, sizeof(src), root, ".bunshin/boot_id");
	path_in(dst, sizeof(dst), root, "proc/sys/kernel/random/boot_id");
	if (access(src, F_OK) < 0)
		return;
	if (mount(src, dst, NULL, MS_BIND, NULL) < 0 ||
	    mount(NULL, dst, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
		report(efd, "bind the boot id");
}

/* Docker's default capability set less NET_RAW, as podman does. Root inside a workspace keeps
 * what package managers, servers and test suites need, and loses what reaches the host:
 * mounts, modules, raw I/O, devices, the clock, reboot, network administration, and raw and
 * packet sockets (forged frames; ping uses ICMP datagram sockets, which the host allows every
 * group of the workspace's network namespace: net.ipv4.ping_group_range, network/__init__.py). */
static const int kept_caps[] = {
	0 /* CHOWN */, 1 /* DAC_OVERRIDE */, 3 /* FOWNER */, 4 /* FSETID */, 5 /* KILL */,
	6 /* SETGID */, 7 /* SETUID */, 8 /* SETPCAP */, 10 /* NET_BIND_SERVICE */,
	18 /* SYS_CHROOT */, 29 /* AUDIT_WRITE */, 31 /* SETFCAP */,
};

static void child_drop_caps(int efd)
{
	/* Only the bounding set: the init is exec'd as root, so its permitted and effective
	 * sets become exactly what the bounding set still allows. */
	for (int cap = 0; cap <= 63; cap++) {
		int keep = 0;
		for (size_t i = 0; i < sizeof(kept_caps) / sizeof(kept_caps[0]); i++)
			keep |= kept_caps[i] == cap;
		if (keep)
			continue;
		if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) {
			if (errno == EINVAL)
				break; /* past the kernel's last capability */
			report(efd, "drop capabilities");
		}
	}
}

/* Last step before exec: everything after it, the init included, runs under the filter. The
 * child still has CAP_SYS_ADMIN in its effective set, so no_new_privs is not needed (Docker
 * does not set it either: setuid programs keep working). */
static void child_load_seccomp(int efd, const struct bn_spawn_cfg *cfg)
{
	struct sock_fprog prog = {
		.len = (unsigned short)(cfg->seccomp_len / sizeof(struct sock_filter)),
		.filter = (struct sock_filter *)cfg->seccomp_bpf,
	};
	if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0)
		report(efd, "load the seccomp filter");
}

static void child_main(const struct bn_spawn_cfg *cfg, int sync_rd, int efd)
{
	char c, path[4096], opts[96];
	/* Wait until the parent has placed us in our cgroups. */
	if (read(sync_rd, &c, 1) != 1)
		_exit(126);
	close(sync_rd);
	/* Only now: the namespace's root is the cgroup we were just placed in, so the workspace
	 * sees "/" there and no host cgroup path. */
	if ((cfg->ns_flags & CLONE_NEWCGROUP) && unshare(CLONE_NEWCGROUP) < 0)
		report(efd, "unshare the cgroup namespace");

	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		report(efd, "make / rprivate");
	/* The root is nodev: a device node that an image's layer or a snapshot carries, or that the
	 * host wrote into a layer, is never opened through it (the standard nodes live on /dev's
	 * own tmpfs). In a user namespace the host mounted the overlay before the clone, nodev (its
	 * root could only mount it with user.* xattrs, unlike every other layer's trusted.* ones);
	 * a bind of it, which keeps that flag, makes a root of our own, free of the locks on mounts
	 * inherited from the host. */
	if (cfg->ns_flags & CLONE_NEWUSER) {
		if (mount(cfg->root, cfg->root, NULL, MS_BIND, NULL) < 0)
			report(efd, "bind the overlay root");
	} else if (mount("overlay", cfg->root, "overlay", MS_NODEV, cfg->overlay_opts) < 0) {
		report(efd, "mount overlay root");
	}
	/* From here on every path is relative to the new root: the namespace's root (below) could
	 * not walk the host's state directories that lead to it. */
	if (chdir(cfg->root) < 0)
		report(efd, "chdir to new root");
	const char *root = ".";
	/* The parent wrote our uid_map and gid_map before releasing us: become the namespace's
	 * root, so that what we mount and create belongs to it (raw syscalls: glibc's setxid would
	 * signal the parent's threads, which this copy lacks), without the host's groups. */
	if (cfg->ns_flags & CLONE_NEWUSER) {
		if (syscall(SYS_setresgid, 0, 0, 0) < 0)
			report(efd, "setresgid(0) in the user namespace");
		if (syscall(SYS_setgroups, 0, NULL) < 0)
			report(efd, "setgroups() in the user namespace");
		if (syscall(SYS_setresuid, 0, 0, 0) < 0)
			report(efd, "setresuid(0) in the user namespace");
	}
	/* /proc first: CRIU needs it mounted before the old root goes away. */
	child_mount(efd, root, "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	child_setup_dev(efd, cfg, root);
	if (!cfg->privileged)
		child_mask_proc(efd, root);
	child_bind_boot_id(efd, root);
	tmpfs_opts(opts, sizeof(opts), cfg, "");
	child_mount(efd, root, "tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts);
	if (cfg->mount_sysfs) {
		child_mount(efd, root, "sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
			    NULL);
		for (size_t i = 0; !cfg->privileged && i < sizeof(sys_masked) / sizeof(sys_masked[0]); i++)
			child_mask(efd, root, "sys", sys_masked[i]);
	}
	path_in(path, sizeof(path), root, "run");
	if (mkdir_p1(path, 0755) < 0)
		report(efd, "mkdir /run");

	/* pivot_root(".", ".") stacks the old root under the new one; detach it. */
	if (syscall(SYS_pivot_root, ".", ".") < 0)
		report(efd, "pivot_root");
	if (umount2(".", MNT_DETACH) < 0)
		report(efd, "detach old root");
	if (chdir("/") < 0)
		report(efd, "chdir /");
	if (cfg->hostname && sethostname(cfg->hostname, strlen(cfg->hostname)) < 0)
		report(efd, "sethostname");
	if (cfg->ns_flags & CLONE_NEWNET)
		child_loopback_up(efd);
	/* Kernels before 6.4 lack the prctl (EINVAL): the workspace runs, unmerged. */
	if (cfg->ksm_merge && prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) < 0 && errno != EINVAL)
		report(efd, "prctl(PR_SET_MEMORY_MERGE)");
	if (!cfg->privileged)
		child_drop_caps(efd);
	if (cfg->seccomp_bpf && cfg->seccomp_len > 0)
		child_load_seccomp(efd, cfg);

	char *argv[] = {"bunshin-init", NULL};
	char *envp[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", NULL};
	execve(cfg->init_path, argv, envp);
	report(efd, "exec init");
}

int bn_spawn(const struct bn_spawn_cfg *cfg, int *pidfd, int *sync_fd, int *err_fd)
{
	int sp[2], ep[2];
	if (pipe2(sp, O_CLOEXEC) < 0)
		return -1;
	if (pipe2(ep, O_CLOEXEC) < 0) {
		close(sp[0]);
		close(sp[1]);
		return -1;
	}
	struct clone_args args;
	memset(&args, 0, sizeof(args));
	/* The cgroup namespace is made by the child once it is in its cgroups (child_main). */
	args.flags = (uint64_t)(cfg->ns_flags & ~CLONE_NEWCGROUP) | CLONE_PIDFD;
	args.pidfd = (uint64_t)(uintptr_t)pidfd;
	args.exit_signal = SIGCHLD;
	long pid = syscall(SYS_clone3, &args, sizeof(args));
	if (pid < 0) {
		int e = errno;
		close(sp[0]);
		close(sp[1]);
		close(ep[0]);
		close(ep[1]);
		errno = e;
		return -1;
	}
	if (pid == 0) {
		close(sp[1]);
		close(ep[0]);
		child_main(cfg, sp[0], ep[1]);
		_exit(127);
	}
	close(sp[0]);
	close(ep[1]);
	*sync_fd = sp[1];
	*err_fd = ep[0];
	return (int)pid;
}

int bn_spawn_release(int sync_fd, int err_fd, char *err, int errlen)
{
	struct step_err e;
	ssize_t n;
	int rc = 0;
	if (write(sync_fd, "g", 1) != 1) {
		snprintf(err, (size_t)errlen, "release child: %s", strerror(errno));
		rc = -1;
	}
	close(sync_fd);
	do
		n = read(err_fd, &e, sizeof(e));
	while (n < 0 && errno == EINTR);
	if (n == (ssize_t)sizeof(e)) {
		snprintf(err, (size_t)errlen, "%s: %s", e.step, strerror(e.err));
		rc = -1;
	}
	close(err_fd);
	return rc;
}
