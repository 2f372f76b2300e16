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

static int wait_stop(pid_t pid, int *status)
{
	for (;;) {
		pid_t r = waitpid(pid, status, __WALL);
		if (r == pid)
			return WIFSTOPPED(*status) ? 0 : -ESRCH;
		if (r < 0 && errno != EINTR)
			return -errno;
	}
}

int bn_ptrace_seize(int pid)
{
	if (ptrace(PTRACE_SEIZE, pid, 0, (void *)(long)PTRACE_O_TRACECLONE) < 0)
		return -errno;
	if (ptrace(PTRACE_INTERRUPT, pid, 0, 0) < 0)
		return -errno;
	return 0;
}

int bn_ptrace_wait_stop(int pid)
{
	int status;
	return wait_stop(pid, &status);
}

int bn_ptrace_detach(int pid)
{
	return ptrace(PTRACE_DETACH, pid, 0, 0) < 0 ? -errno : 0;
}

/*
 * Run one syscall in a stopped tracee: write `syscall; int3` over the bytes at its
 * instruction pointer, run to the trap, restore code and registers. When the
 * syscall is a clone, the new child's pid is stored in *clone_child.
 */
static long inject_syscall(pid_t pid, long nr, long a1, long a2, long a3, long a4, long a5, long a6,
			   pid_t *clone_child)
{
	struct user_regs_struct saved, regs;
	long orig, code, ret;
	int status;

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
		if (wait_stop(pid, &status) < 0) {
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
				wait_stop((pid_t)child, &cs);
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

int bn_inject_fork(int pid, int *ns_child)
{
	pid_t child = 0;
	/* clone(flags = exit signal 0, no CLONE_VM): a fork the parent will never hear about. */
	long r = inject_syscall(pid, SYS_clone, 0, 0, 0, 0, 0, 0, &child);
	if (r < 0)
		return (int)r;
	if (child <= 0 || r <= 0)
		return -ECHILD;
	/* The tracee's clone() returns the pid in its own namespace; the event message ours. */
	*ns_child = (int)r;
	return child;
}

int bn_inject_reap(int parent, int child)
{
	long r = inject_syscall(parent, SYS_wait4, child, 0, __WALL, 0, 0, 0, NULL);
	return r == child ? 0 : (r < 0 ? (int)r : -ECHILD);
}
