/*
 * The freeze watchdog: `bunshin-init --watchdog FREEZE_FILE DEADLINE_MS LOG_FILE LABEL`.
 *
 * Started (outside the workspace's cgroup, in a session of its own) by the process that is
 * about to freeze a workspace, with the read end of a pipe as stdin. That process writes
 * "k PID\n" for each helper it starts (CRIU) and "d\n" once it has thawed the workspace; the
 * watchdog then exits without doing anything. If the pipe reaches end-of-file first (the
 * forking process died) or the deadline passes, the watchdog thaws the cgroup itself:
 *
 *  - at the deadline it kills the registered helpers first (their work is past its time);
 *  - when the owner died it lets them finish (a CRIU that loses its client fails, cures its
 *    parasites and detaches; killed mid-dump, a parasite would take its process down), but
 *    thaws again whenever they re-freeze (CRIU restores the freezer state it found), and
 *    kills whatever is left at the deadline.
 *
 * Either way it appends one JSON line to LOG_FILE saying what it did and how long the
 * workspace had been frozen. It uses raw syscalls and stack buffers only.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "watchdog.h"

#define MAX_HELPERS 16

static long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void thaw(const char *freeze_file)
{
	int fd = open(freeze_file, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return; /* the cgroup is gone: nothing is frozen */
	(void)!write(fd, "0", 1);
	close(fd);
}

static int frozen(const char *freeze_file)
{
	char buf[4] = "";
	int fd = open(freeze_file, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	return n > 0 && buf[0] == '1';
}

struct helpers {
	int pidfd[MAX_HELPERS];
	int n;
};

static void add_helper(struct helpers *h, int pid)
{
	if (h->n == MAX_HELPERS || pid <= 0)
		return;
	int fd = (int)syscall(SYS_pidfd_open, pid, 0);
	if (fd >= 0)
		h->pidfd[h->n++] = fd;
}

static int helpers_alive(struct helpers *h)
{
	int alive = 0;
	for (int i = 0; i < h->n; i++) {
		struct pollfd p = {.fd = h->pidfd[i], .events = POLLIN};
		if (h->pidfd[i] >= 0 && poll(&p, 1, 0) == 0)
			alive++;
	}
	return alive;
}

static void kill_helpers(struct helpers *h)
{
	for (int i = 0; i < h->n; i++)
		syscall(SYS_pidfd_send_signal, h->pidfd[i], SIGKILL, NULL, 0);
}

/* Reads what the owner wrote; returns 1 on "d", -1 on end-of-file, 0 otherwise. */
static int read_owner(struct helpers *h, char *buf, size_t *len, size_t cap)
{
	ssize_t n = read(0, buf + *len, cap - 1 - *len);
	if (n == 0)
		return -1;
	if (n < 0)
		return errno == EINTR || errno == EAGAIN ? 0 : -1;
	*len += (size_t)n;
	buf[*len] = 0;
	char *line = buf, *nl;
	while ((nl = strchr(line, '\n'))) {
		*nl = 0;
		if (line[0] == 'd')
			return 1;
		if (line[0] == 'k')
			add_helper(h, atoi(line + 1));
		line = nl + 1;
	}
	*len = strlen(line);
	memmove(buf, line, *len + 1);
	return 0;
}

static void log_event(const char *path, const char *label, const char *reason, long long frozen_ms,
		      int killed)
{
	char line[512];
	struct timespec wall;
	clock_gettime(CLOCK_REALTIME, &wall);
	int n = snprintf(line, sizeof(line),
			 "{\"time\": %lld.%03ld, \"workspace\": \"%s\", \"reason\": \"%s\", "
			 "\"frozen_seconds\": %lld.%03lld, \"helpers_killed\": %d}\n",
			 (long long)wall.tv_sec, wall.tv_nsec / 1000000, label, reason, frozen_ms / 1000,
			 frozen_ms % 1000, killed);
	int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
	if (fd < 0 || n <= 0)
		return;
	(void)!write(fd, line, (size_t)n);
	close(fd);
}

int watchdog_main(int argc, char **argv)
{
	if (argc != 6) {
		fprintf(stderr, "usage: bunshin-init --watchdog FREEZE_FILE DEADLINE_MS LOG_FILE LABEL\n");
		return 2;
	}
	const char *freeze_file = argv[2], *log_file = argv[4], *label = argv[5];
	long long start = now_ms(), deadline = start + atoll(argv[3]);
	struct helpers h = {.n = 0};
	char buf[256] = "";
	size_t len = 0;
	const char *reason = "deadline";

	signal(SIGPIPE, SIG_IGN);
	for (;;) {
		long long left = deadline - now_ms();
		if (left <= 0)
			break;
		struct pollfd p = {.fd = 0, .events = POLLIN};
		int r = poll(&p, 1, left > 1000000 ? 1000000 : (int)left);
		if (r < 0 && errno != EINTR)
			break;
		if (r > 0) {
			int got = read_owner(&h, buf, &len, sizeof(buf));
			if (got == 1)
				return 0;
			if (got < 0) {
				reason = "owner died";
				break;
			}
		}
	}

	int killed = 0;
	if (now_ms() >= deadline && helpers_alive(&h)) {
		killed = helpers_alive(&h);
		kill_helpers(&h);
	}
	thaw(freeze_file);
	long long thawed_at = now_ms();
	/* Keep it thawed while a helper may still re-freeze it, until the deadline (or, when
	 * they were just killed, for the moment they take to die). */
	long long until = deadline > thawed_at ? deadline : thawed_at + 2000;
	while (helpers_alive(&h) && now_ms() < until) {
		struct timespec ts = {0, 20 * 1000000};
		nanosleep(&ts, NULL);
		if (frozen(freeze_file))
			thaw(freeze_file);
	}
	if (helpers_alive(&h)) {
		killed += helpers_alive(&h);
		kill_helpers(&h);
		struct timespec ts = {0, 100 * 1000000};
		nanosleep(&ts, NULL);
	}
	thaw(freeze_file);
	log_event(log_file, label, reason, thawed_at - start, killed);
	return 0;
}
