/*
 * bunshin-init: PID 1 of every workspace.
 *
 * It owns nothing but a listening unix socket inside the workspace's own file
 * system (/.bunshin/ctl.sock). Each connection is served by a forked "shim", so
 * every command is a descendant of this init: a later fork of the workspace
 * (CRIU walks the tree from here) carries whatever a command left running.
 * Between calls no descriptor connects the workspace to the host, which is what
 * lets CRIU dump it without external-resource options.
 *
 * Request (client -> shim): u32 little-endian length, then NUL-terminated
 * strings. The first is the operation; the rest are tagged by their first byte:
 *   a<argv item>  e<KEY=VALUE>  c<cwd>  i<command id>  p<pid>  s<signal>
 * Operations: run (foreground, output streamed), spawn (background, output to
 * /.bunshin/cmd/<id>/{stdout,stderr}, wait status to .../exit), kill, ping.
 * Reply frames (shim -> client): 1 byte type, u32 little-endian length, data.
 *   'P' pid (decimal)   'O' stdout bytes   'E' stderr bytes
 *   'X' wait status (decimal)   'F' failure message (errno text)
 * A client that disconnects during `run` kills the command's process group:
 * that is how a timeout is enforced.
 *
 * A shim closes its connection before anything the client waits for can end (the
 * last frame of a reply, or the client's hang-up), so once the client has seen EOF
 * no process of the workspace holds a socket whose peer is outside it, and a
 * snapshot taken right after any call finds none.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "watchdog.h"

#define CTL_DIR "/.bunshin"
#define CTL_SOCK CTL_DIR "/ctl.sock"
#define CMD_DIR CTL_DIR "/cmd"
#define MAX_REQ (1 << 20)
#define MAX_ITEMS 4096
#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#endif

static const int forwarded[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};

static int write_all(int fd, const void *buf, size_t len)
{
	const char *p = buf;
	while (len) {
		ssize_t n = write(fd, p, len);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

static int read_all(int fd, void *buf, size_t len)
{
	char *p = buf;
	while (len) {
		ssize_t n = read(fd, p, len);
		if (n == 0)
			return -1;
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

static int send_frame(int fd, char type, const void *data, uint32_t len)
{
	unsigned char hdr[5] = {(unsigned char)type, len & 0xff, (len >> 8) & 0xff,
				(len >> 16) & 0xff, (len >> 24) & 0xff};
	if (write_all(fd, hdr, sizeof(hdr)) < 0)
		return -1;
	return len ? write_all(fd, data, len) : 0;
}

static int send_text(int fd, char type, const char *fmt, ...)
{
	char buf[512];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	if (n < 0)
		n = 0;
	if ((size_t)n >= sizeof(buf))
		n = sizeof(buf) - 1;
	return send_frame(fd, type, buf, (uint32_t)n);
}

struct request {
	const char *op;
	const char *cwd;
	const char *id;
	pid_t pid;
	int sig;
	char *argv[MAX_ITEMS];
	char *envp[MAX_ITEMS];
	int argc, envc;
};

static int parse_request(char *buf, uint32_t len, struct request *rq)
{
	memset(rq, 0, sizeof(*rq));
	if (len == 0 || buf[len - 1] != '\0')
		return -1;
	char *p = buf, *end = buf + len;
	rq->op = p;
	p += strlen(p) + 1;
	while (p < end) {
		char tag = *p;
		char *val = p + 1;
		switch (tag) {
		case 'a':
			if (rq->argc >= MAX_ITEMS - 1)
				return -1;
			rq->argv[rq->argc++] = val;
			break;
		case 'e':
			if (rq->envc >= MAX_ITEMS - 1)
				return -1;
			rq->envp[rq->envc++] = val;
			break;
		case 'c':
			rq->cwd = val;
			break;
		case 'i':
			rq->id = val;
			break;
		case 'p':
			rq->pid = (pid_t)atoi(val);
			break;
		case 's':
			rq->sig = atoi(val);
			break;
		default:
			return -1;
		}
		p += strlen(p) + 1;
	}
	return 0;
}

static void reset_signals(void)
{
	sigset_t all;
	sigemptyset(&all);
	sigprocmask(SIG_SETMASK, &all, NULL);
	for (int s = 1; s < NSIG; s++)
		signal(s, SIG_DFL);
}

/*
 * Fork the command. The child gets its own process group so that a timeout can
 * kill everything it started in the foreground. An exec failure travels back
 * over a CLOEXEC pipe, so the caller learns ENOENT for a missing binary or bad cwd
 * instead of a bare exit code.
 */
static pid_t start_command(struct request *rq, int out_fd, int err_fd, char *errbuf, size_t errlen)
{
	int ep[2];
	if (pipe2(ep, O_CLOEXEC) < 0) {
		snprintf(errbuf, errlen, "pipe: %s", strerror(errno));
		return -1;
	}
	pid_t pid = fork();
	if (pid < 0) {
		snprintf(errbuf, errlen, "fork: %s", strerror(errno));
		close(ep[0]);
		close(ep[1]);
		return -1;
	}
	if (pid == 0) {
		int stage = 0;
		close(ep[0]);
		setpgid(0, 0);
		int devnull = open("/dev/null", O_RDONLY);
		if (devnull < 0 || dup2(devnull, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0)
			goto fail;
		stage = 1;
		if (rq->cwd && chdir(rq->cwd) < 0)
			goto fail;
		stage = 2;
		rq->envp[rq->envc] = NULL;
		rq->argv[rq->argc] = NULL;
		environ = rq->envp;
		execvp(rq->argv[0], rq->argv);
fail:;
		int e[2] = {errno, stage};
		write_all(ep[1], e, sizeof(e));
		_exit(127);
	}
	close(ep[1]);
	int e[2];
	if (read_all(ep[0], e, sizeof(e)) == 0) {
		const char *what = e[1] == 1 ? "cwd" : e[1] == 2 ? "exec" : "stdio";
		snprintf(errbuf, errlen, "%s %s: %s", what,
			 e[1] == 1 ? rq->cwd : e[1] == 2 ? rq->argv[0] : "", strerror(e[0]));
		close(ep[0]);
		waitpid(pid, NULL, 0);
		return -1;
	}
	close(ep[0]);
	return pid;
}

static void drain_discard(int *fds, int n)
{
	char buf[65536];
	struct pollfd pf[2];
	for (;;) {
		int m = 0;
		for (int i = 0; i < n; i++)
			if (fds[i] >= 0)
				pf[m++] = (struct pollfd){.fd = fds[i], .events = POLLIN};
		if (!m)
			return;
		if (poll(pf, m, -1) < 0 && errno != EINTR)
			return;
		for (int i = 0; i < m; i++) {
			if (!pf[i].revents)
				continue;
			ssize_t r = read(pf[i].fd, buf, sizeof(buf));
			if (r <= 0)
				for (int j = 0; j < n; j++)
					if (fds[j] == pf[i].fd) {
						close(fds[j]);
						fds[j] = -1;
					}
		}
	}
}

static long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

/* How long output is still forwarded after the command exits (see op_run). */
#define EXIT_QUIET_MS 50
#define EXIT_GRACE_MS 250

static int op_run(int conn, struct request *rq)
{
	int op[2], ep[2];
	char err[512];
	if (rq->argc == 0)
		return send_text(conn, 'F', "EINVAL empty argv");
	if (pipe2(op, O_CLOEXEC) < 0 || pipe2(ep, O_CLOEXEC) < 0)
		return send_text(conn, 'F', "pipe: %s", strerror(errno));
	pid_t pid = start_command(rq, op[1], ep[1], err, sizeof(err));
	close(op[1]);
	close(ep[1]);
	if (pid < 0)
		return send_text(conn, 'F', "%s", err);
	send_text(conn, 'P', "%d", pid);

	int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
	int fds[2] = {op[0], ep[0]};
	int status = 0, exited = 0, client = 1;
	long long exited_at = 0;
	char buf[65536];
	while (!exited || fds[0] >= 0 || fds[1] >= 0) {
		struct pollfd pf[4];
		int m = 0, idx_out = -1, idx_err = -1, idx_pid = -1, idx_conn = -1;
		if (fds[0] >= 0)
			idx_out = m, pf[m++] = (struct pollfd){.fd = fds[0], .events = POLLIN};
		if (fds[1] >= 0)
			idx_err = m, pf[m++] = (struct pollfd){.fd = fds[1], .events = POLLIN};
		if (!exited && pidfd >= 0)
			idx_pid = m, pf[m++] = (struct pollfd){.fd = pidfd, .events = POLLIN};
		if (client)
			idx_conn = m, pf[m++] = (struct pollfd){.fd = conn, .events = POLLIN | POLLRDHUP};
		/* After the command exits, a daemon it left behind may hold the pipes open
		 * forever: give its last output a moment, then stop forwarding. (A pipe holds
		 * no more than one read, so the command's own output is already in hand.) The
		 * moment is bounded in total, or a daemon that keeps writing would hold the
		 * reply back until the client's timeout kills it. */
		int timeout = pidfd < 0 ? 100 : -1;
		if (exited) {
			long long left = exited_at + EXIT_GRACE_MS - now_ms();
			if (left <= 0)
				break;
			timeout = left < EXIT_QUIET_MS ? (int)left : EXIT_QUIET_MS;
		}
		int r = poll(pf, m, timeout);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		if (r == 0 && exited)
			break;
		if (idx_conn >= 0 && (pf[idx_conn].revents & (POLLIN | POLLHUP | POLLRDHUP | POLLERR))) {
			char c;
			if (recv(conn, &c, 1, MSG_DONTWAIT) <= 0) {
				/* Client gone (timeout or crash): the foreground job dies with it. The
				 * connection goes first, so a client waiting for our EOF is released
				 * before the job has finished dying. */
				close(conn);
				conn = -1;
				kill(-pid, SIGKILL);
				kill(pid, SIGKILL);
				client = 0;
			}
		}
		for (int k = 0; k < 2; k++) {
			int idx = k == 0 ? idx_out : idx_err;
			if (idx < 0 || !pf[idx].revents)
				continue;
			ssize_t n = read(fds[k], buf, sizeof(buf));
			if (n <= 0) {
				close(fds[k]);
				fds[k] = -1;
			} else if (client && send_frame(conn, k == 0 ? 'O' : 'E', buf, (uint32_t)n) < 0) {
				close(conn);
				conn = -1;
				client = 0;
				kill(-pid, SIGKILL);
			}
		}
		if ((idx_pid >= 0 && pf[idx_pid].revents) || (pidfd < 0 && !exited)) {
			if (waitpid(pid, &status, pidfd < 0 ? WNOHANG : 0) == pid)
				exited = 1, exited_at = now_ms();
		}
	}
	if (!exited)
		waitpid(pid, &status, 0);
	if (client)
		send_text(conn, 'X', "%d", status);
	if (conn >= 0)
		close(conn);
	if (pidfd >= 0)
		close(pidfd);
	/* Keep the read ends open for background processes that inherited the pipes,
	 * so they do not die of SIGPIPE; their output goes nowhere. */
	drain_discard(fds, 2);
	return 0;
}

static int valid_id(const char *id)
{
	if (!id || !*id || strlen(id) > 64)
		return 0;
	for (const char *p = id; *p; p++)
		if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '-'))
			return 0;
	return 1;
}

static int op_spawn(int conn, struct request *rq)
{
	char dir[128], path[160], tmp[160], err[512];
	if (rq->argc == 0 || !valid_id(rq->id))
		return send_text(conn, 'F', "EINVAL spawn needs argv and an id of [a-z0-9-]");
	mkdir(CMD_DIR, 0700);
	snprintf(dir, sizeof(dir), CMD_DIR "/%s", rq->id);
	if (mkdir(dir, 0700) < 0)
		return send_text(conn, 'F', "mkdir %s: %s", dir, strerror(errno));
	snprintf(path, sizeof(path), "%s/stdout", dir);
	int out = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
	snprintf(path, sizeof(path), "%s/stderr", dir);
	int errf = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
	if (out < 0 || errf < 0)
		return send_text(conn, 'F', "open output: %s", strerror(errno));
	pid_t pid = start_command(rq, out, errf, err, sizeof(err));
	close(out);
	close(errf);
	if (pid < 0)
		return send_text(conn, 'F', "%s", err);
	send_text(conn, 'P', "%d", pid);
	close(conn);
	int status;
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	/* The exit file appears atomically, so a reader never sees a partial status. */
	snprintf(tmp, sizeof(tmp), "%s/exit.tmp", dir);
	snprintf(path, sizeof(path), "%s/exit", dir);
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd >= 0) {
		char s[32];
		int n = snprintf(s, sizeof(s), "%d\n", status);
		write_all(fd, s, (size_t)n);
		close(fd);
		rename(tmp, path);
	}
	return 0;
}

static void serve(int conn)
{
	uint32_t len;
	static char buf[MAX_REQ];
	static struct request rq;
	if (read_all(conn, &len, sizeof(len)) < 0 || len > MAX_REQ || read_all(conn, buf, len) < 0)
		_exit(1);
	if (parse_request(buf, len, &rq) < 0) {
		send_text(conn, 'F', "EINVAL malformed request");
		_exit(1);
	}
	/* A caller that gave up (a request sent while the workspace was paused, then timed out)
	 * was told it failed: acting on it after a resume would surprise it. Callers never shut
	 * down their write side, so a hang-up means exactly that. */
	{
		struct pollfd pfd = { .fd = conn, .events = POLLRDHUP };
		if (poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP)))
			_exit(0);
	}
	if (!strcmp(rq.op, "run"))
		op_run(conn, &rq);
	else if (!strcmp(rq.op, "spawn"))
		op_spawn(conn, &rq);
	else if (!strcmp(rq.op, "kill")) {
		if (rq.pid == 0 || rq.pid == 1 || rq.pid == -1 || kill(rq.pid, rq.sig ? rq.sig : SIGTERM) < 0)
			send_text(conn, 'F', "kill %d: %s", rq.pid, (rq.pid == 0 || rq.pid == 1 || rq.pid == -1) ? "refused" : strerror(errno));
		else
			send_text(conn, 'X', "0");
	} else if (!strcmp(rq.op, "ping"))
		send_text(conn, 'X', "0");
	else
		send_text(conn, 'F', "EINVAL unknown operation %s", rq.op);
	_exit(0);
}

static int listen_ctl(void)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	mkdir(CTL_DIR, 0700);
	unlink(CTL_SOCK);
	strcpy(addr.sun_path, CTL_SOCK);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0 || listen(fd, 128) < 0)
		return -1;
	return fd;
}

/*
 * Second personality, used on the host: `bunshin-init --ksm-exec PROGRAM ARGS...` opts
 * itself into KSM and execs PROGRAM, which keeps the opt-in and hands it to every process
 * it forks. This is how CRIU is started for ksm forks: Python could only do the prctl in a
 * preexec_fn, which makes subprocess fork() the multi-threaded caller and run every
 * library's atfork handlers there.
 */
static int ksm_exec(char **argv)
{
	if (prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) < 0) {
		perror("bunshin-init --ksm-exec: prctl(PR_SET_MEMORY_MERGE)");
		return 126;
	}
	execvp(argv[0], argv);
	fprintf(stderr, "bunshin-init --ksm-exec: exec %s: %s\n", argv[0], strerror(errno));
	return 127;
}

int main(int argc, char **argv)
{
	if (argc > 2 && !strcmp(argv[1], "--ksm-exec"))
		return ksm_exec(argv + 2);
	if (argc > 1 && !strcmp(argv[1], "--watchdog"))
		return watchdog_main(argc, argv);
	setsid();
	/* Nothing from the creator may stay open inside the workspace. */
	int devnull = open("/dev/null", O_RDWR);
	if (devnull >= 0) {
		dup2(devnull, 0);
		dup2(devnull, 1);
		dup2(devnull, 2);
	}
	syscall(SYS_close_range, 3, ~0U, 0);
	chdir("/");

	sigset_t mask;
	sigemptyset(&mask);
	sigaddset(&mask, SIGCHLD);
	for (size_t i = 0; i < sizeof(forwarded) / sizeof(forwarded[0]); i++)
		sigaddset(&mask, forwarded[i]);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
	int lfd = listen_ctl();
	if (sfd < 0 || lfd < 0)
		return 1;

	int terminating = 0;
	for (;;) {
		struct pollfd pf[2] = {{.fd = sfd, .events = POLLIN}, {.fd = lfd, .events = POLLIN}};
		int r = poll(pf, terminating ? 1 : 2, terminating ? 100 : -1);
		if (r < 0 && errno != EINTR)
			return 1;
		if (pf[0].revents & POLLIN) {
			struct signalfd_siginfo si;
			while (read(sfd, &si, sizeof(si)) == sizeof(si)) {
				if (si.ssi_signo == SIGCHLD)
					continue;
				/* Forward to every process in the namespace; kill(-1) skips init itself. */
				kill(-1, (int)si.ssi_signo);
				if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT)
					terminating = 1;
			}
		}
		int status;
		pid_t p;
		while ((p = waitpid(-1, &status, WNOHANG)) > 0)
			;
		if (terminating && p < 0 && errno == ECHILD)
			return 0;
		if (!terminating && (pf[1].revents & POLLIN)) {
			int conn = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
			if (conn < 0)
				continue;
			pid_t shim = fork();
			if (shim == 0) {
				close(lfd);
				close(sfd);
				reset_signals();
				serve(conn);
			}
			close(conn);
		}
	}
}
