/*
 * Syscall injection into a ptrace-stopped task (x86-64), used to make memory
 * snapshot holders: a fork() injected into a frozen workspace process yields a
 * child whose mm is a copy-on-write image of the process at freeze time.
 *
 * The clone uses exit signal 0, so the parent never gets SIGCHLD, and
 * PTRACE_O_TRACECLONE makes the child start traced and stopped: it never runs a
 * single instruction of its own. Killing it and injecting wait4(child, __WALL)
 * into the parent leaves no process, zombie, signal or fd behind.
 *
 * libcompel can inject syscalls too, but it has no hook for the clone event stop,
 * which is the whole point here; this is the small part of it that is needed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <unistd.h>

#include "native.h"

#ifndef __WALL
#define __WALL 0x40000000
#endif

static long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/*
 * Wait for `pid` to report a stop, until `deadline` (CLOCK_MONOTONIC ns; 0: none). A blocking
 * waitpid cannot time out, so poll with WNOHANG: the stop is usually there at once or within
 * microseconds, and the sleeps grow from 20 us to 2 ms.
 */
static int wait_stop_until(pid_t pid, int *status, long long deadline)
{
	long sleep_ns = 20000;
	for (;;) {
		pid_t r = waitpid(pid, status, __WALL | WNOHANG);
		if (r == pid)
			return WIFSTOPPED(*status) ? 0 : -ESRCH;
		if (r < 0 && errno != EINTR)
			return -errno;
		if (r == 0) {
			if (deadline && now_ns() >= deadline)
				return -ETIMEDOUT;
			struct timespec ts = {0, sleep_ns};
			nanosleep(&ts, NULL);
			if (sleep_ns < 2000000)
				sleep_ns *= 2;
		}
	}
}

static long long deadline_in(int timeout_ms)
{
	return timeout_ms > 0 ? now_ns() + (long long)timeout_ms * 1000000LL : 0;
}

int bn_ptrace_seize(int pid)
{
	if (ptrace(PTRACE_SEIZE, pid, 0, (void *)(long)PTRACE_O_TRACECLONE) < 0)
		return -errno;
	if (ptrace(PTRACE_INTERRUPT, pid, 0, 0) < 0)
		return -errno;
	return 0;
}

int bn_ptrace_wait_stop(int pid, int timeout_ms)
{
	int status;
	return wait_stop_until(pid, &status, deadline_in(timeout_ms));
}

int bn_ptrace_detach(int pid)
{
	return ptrace(PTRACE_DETACH, pid, 0, 0) < 0 ? -errno : 0;
}

/*
 * Run one syscall in a stopped tracee: write `syscall; int3` over the bytes at its
 * instruction pointer, run to the trap, restore code and registers. When the
 * syscall is a clone, the new child's pid is stored in *clone_child.
 *
 * Past `timeout_ms` the tracee is interrupted (PTRACE_INTERRUPT ends an interruptible
 * wait in the kernel; the syscall is not restarted) and its code and registers are put
 * back as soon as it stops; -ETIMEDOUT is returned either way.
 */
static long inject_syscall(pid_t pid, long nr, long a1, long a2, long a3, long a4, long a5, long a6,
			   pid_t *clone_child, int timeout_ms)
{
	struct user_regs_struct saved, regs;
	long orig, code, ret;
	int status, w;
	long long deadline = deadline_in(timeout_ms);

	if (ptrace(PTRACE_GETREGS, pid, 0, &saved) < 0)
		return -errno;
	errno = 0;
	orig = ptrace(PTRACE_PEEKTEXT, pid, (void *)saved.rip, 0);
	if (errno)
		return -errno;
	/* 0f 05 = syscall, cc = int3; the rest of the word keeps its original bytes. */
	code = (orig & ~0xffffffL) | 0xcc050fL;
	if (ptrace(PTRACE_POKETEXT, pid, (void *)saved.rip, (void *)code) < 0)
		return -errno;
	regs = saved;
	regs.rax = nr;
	regs.rdi = a1;
	regs.rsi = a2;
	regs.rdx = a3;
	regs.r10 = a4;
	regs.r8 = a5;
	regs.r9 = a6;
	/* Not restarting an interrupted syscall: orig_rax -1 keeps the kernel from rewinding rip. */
	regs.orig_rax = -1;
	ret = -EIO;
	if (ptrace(PTRACE_SETREGS, pid, 0, &regs) < 0) {
		ret = -errno;
		goto restore;
	}
	if (ptrace(PTRACE_CONT, pid, 0, 0) < 0) {
		ret = -errno;
		goto restore;
	}
	for (;;) {
		w = wait_stop_until(pid, &status, deadline);
		if (w == -ETIMEDOUT) {
			ptrace(PTRACE_INTERRUPT, pid, 0, 0);
			/* A task stuck in an uninterruptible wait cannot be stopped to restore its
			 * code: give it one more timeout, then report it rather than block. */
			if (wait_stop_until(pid, &status, deadline_in(timeout_ms)) < 0)
				return -ETIMEDOUT;
			if (status >> 8 == (SIGTRAP | (PTRACE_EVENT_CLONE << 8))) {
				/* The clone completed just now: its child must not run. */
				unsigned long child = 0;
				if (ptrace(PTRACE_GETEVENTMSG, pid, 0, &child) == 0 && child > 0)
					kill((pid_t)child, SIGKILL);
			}
			ret = -ETIMEDOUT;
			goto restore;
		}
		if (w < 0) {
			ret = -ESRCH;
			goto restore;
		}
		if (status >> 8 == (SIGTRAP | (PTRACE_EVENT_CLONE << 8))) {
			unsigned long child = 0;
			ptrace(PTRACE_GETEVENTMSG, pid, 0, &child);
			if (clone_child) {
				int cs;
				*clone_child = (pid_t)child;
				/* The auto-attached child reports its initial stop; collect it. */
				wait_stop_until((pid_t)child, &cs, deadline);
				/* Should we die, the holder must die too: untraced, it would run on from
				 * the middle of its parent's code as a second copy of that process. */
				ptrace(PTRACE_SETOPTIONS, (pid_t)child, 0, (void *)(long)PTRACE_O_EXITKILL);
				/* The child's memory was copied with `syscall; int3` at rip: put the
				 * original bytes back, or an image of it (a snapshot holder) keeps the
				 * stub, and a clone sharing that text page traps at the int3. */
				ptrace(PTRACE_POKETEXT, (pid_t)child, (void *)saved.rip, (void *)orig);
			}
			ptrace(PTRACE_CONT, pid, 0, 0);
			continue;
		}
		if (WSTOPSIG(status) == SIGTRAP)
			break;
		/* Another signal arrived meanwhile: it stays pending and is delivered after we detach. */
		ptrace(PTRACE_CONT, pid, 0, 0);
	}
	if (ptrace(PTRACE_GETREGS, pid, 0, &regs) < 0)
		ret = -errno;
	else
		ret = (long)regs.rax;
restore:
	ptrace(PTRACE_POKETEXT, pid, (void *)saved.rip, (void *)orig);
	ptrace(PTRACE_SETREGS, pid, 0, &saved);
	return ret;
}

int bn_inject_fork(int pid, int *ns_child, int timeout_ms)
{
	pid_t child = 0;
	/* clone(flags = exit signal 0, no CLONE_VM): a fork the parent will never hear about. */
	long r = inject_syscall(pid, SYS_clone, 0, 0, 0, 0, 0, 0, &child, timeout_ms);
	if (r < 0)
		return (int)r;
	if (child <= 0 || r <= 0)
		return -ECHILD;
	/* The tracee's clone() returns the pid in its own namespace; the event message ours. */
	*ns_child = (int)r;
	return child;
}

int bn_inject_reap(int parent, int child, int timeout_ms)
{
	/* WNOHANG: a wait4 that blocks would hold the parent in the kernel past any deadline. */
	long r = inject_syscall(parent, SYS_wait4, child, 0, __WALL | WNOHANG, 0, 0, 0, NULL, timeout_ms);
	if (r == 0)
		return -EAGAIN;
	return r == child ? 0 : (r < 0 ? (int)r : -ECHILD);
}

int bn_inject_syscall(int pid, long nr, long a1, long a2, long a3, int timeout_ms, long *result)
{
	long r = inject_syscall(pid, nr, a1, a2, a3, 0, 0, 0, NULL, timeout_ms);
	*result = r;
	return r == -ETIMEDOUT ? -ETIMEDOUT : 0;
}
