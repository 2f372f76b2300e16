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
 *   u<uid:gid[:gid,gid...]> (run as this user)
 *   n<input> (the command's stdin: "pipe", or "pty:ROWS:COLS" for a terminal;
 *             default /dev/null)
 * Operations: run (foreground, output streamed), spawn (background, output to
 * /.bunshin/cmd/<id>/{stdout,stderr}, wait status to .../exit), kill, ping.
 * While a command of run or spawn runs, its request is kept in /.bunshin/procs/<pid>.
 * Reply frames (shim -> client): 1 byte type, u32 little-endian length, data.
 *   'P' pid (decimal)   'O' stdout bytes (a terminal's output)   'E' stderr bytes
 *   'X' wait status (decimal)   'F' failure message (errno text)
 * A client that disconnects during `run` kills the command's process group:
 * that is how a timeout is enforced.
 *
 * A shim closes its connection before anything the client waits for can end (the
 * last frame of a reply, or the client's hang-up), so once the client has seen EOF
 * no process of the workspace holds a socket whose peer is outside it, and a
 * snapshot taken right after any call finds none. Input connections likewise: a
 * client waits for the shim's EOF after its last acknowledgement.
 *
 * Input. A command with an input has its shim listen on /.bunshin/io/<pid>;
 * clients send it frames in the reply format and get 'X' or 'F' for each:
 *   'I' bytes for stdin   'C' close stdin   'R' "ROWS COLS" (resize the terminal)
 * The client of a foreground `run` may also send these frames on its own
 * connection (no acknowledgements there).
 *
 * Lifetime. The host writes it into a page of this process's memory at a fixed
 * address (LIFETIME_ADDR; process/lifetime.py), never into the workspace's file
 * system, where root inside could delete or rewrite it: the init is not dumpable,
 * so only a process that may ptrace it (the host; root inside has no
 * CAP_SYS_PTRACE) can write it. The init reads it whenever it wakes (SIGRTMIN+1
 * wakes it after the host shortened it) and, past the deadline, or when the host
 * has not renewed the lease for LEASE_MS, kills every process of the workspace
 * and exits, whether or not the process that created the workspace is still
 * there. It fails closed: a lifetime that does not check out, or none within
 * LIFE_GRACE_MS of a new init's start, ends the workspace just the same.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
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
#define IO_DIR CTL_DIR "/io"
#define PROCS_DIR CTL_DIR "/procs"
#define MAX_REQ (1 << 20)
#define MAX_ITEMS 4096
#define MAX_FRAME (1 << 20)
#define MAX_IO_CLIENTS 8
#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#endif
/* Sent by the host after it shortened the lifetime: re-read it now. */
#define SIG_LIFETIME (SIGRTMIN + 1)

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

static void set_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	if (fl >= 0)
		fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

struct request {
	const char *op;
	const char *cwd;
	const char *id;
	const char *user;
	const char *input;
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
		case 'u':
			rq->user = val;
			break;
		case 'n':
			rq->input = val;
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

/* ---- users: "uid:gid[:gid,gid...]", resolved by the host from the workspace's /etc ---- */

static int switch_user(const char *spec)
{
	char *end;
	errno = EINVAL;
	long uid = strtol(spec, &end, 10);
	if (end == spec || *end != ':' || uid < 0)
		return -1;
	const char *p = end + 1;
	long gid = strtol(p, &end, 10);
	if (end == p || (*end != ':' && *end != '\0') || gid < 0)
		return -1;
	gid_t groups[64];
	int n = 0;
	if (*end == ':') {
		p = end + 1;
		while (*p && n < 64) {
			long g = strtol(p, &end, 10);
			if (end == p || g < 0)
				return -1;
			groups[n++] = (gid_t)g;
			p = *end == ',' ? end + 1 : end;
			if (*p && *end != ',')
				return -1;
		}
	}
	if (setgroups((size_t)n, groups) < 0 || setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) < 0 ||
	    setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0)
		return -1;
	return 0;
}

/* ---- input: a stdin pipe or a terminal, fed by clients ---- */

enum { IN_NONE, IN_PIPE, IN_PTY };

struct input {
	int mode;
	int fd;          /* the pipe's write end, or the terminal's master; -1 once closed */
	int close_after; /* close it once the pending bytes are written */
	char *pending;
	size_t plen;
	unsigned short rows, cols;
	char slave[64];
};

static int parse_input(const char *spec, struct input *in)
{
	memset(in, 0, sizeof(*in));
	in->fd = -1;
	if (!spec || !*spec)
		return 0;
	if (!strcmp(spec, "pipe")) {
		in->mode = IN_PIPE;
		return 0;
	}
	unsigned rows = 0, cols = 0;
	if (sscanf(spec, "pty:%u:%u", &rows, &cols) == 2 && rows && cols && rows < 65536 && cols < 65536) {
		in->mode = IN_PTY;
		in->rows = (unsigned short)rows;
		in->cols = (unsigned short)cols;
		return 0;
	}
	return -1;
}

static int resize(struct input *in, const char *text)
{
	unsigned rows = 0, cols = 0;
	if (in->mode != IN_PTY || in->fd < 0) {
		errno = ENOTTY;
		return -1;
	}
	if (sscanf(text, "%u %u", &rows, &cols) != 2 || !rows || !cols || rows > 65535 || cols > 65535) {
		errno = EINVAL;
		return -1;
	}
	struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
	return ioctl(in->fd, TIOCSWINSZ, &ws);
}

static int queue_input(struct input *in, const char *data, size_t len)
{
	if (in->mode == IN_NONE || in->fd < 0 || in->close_after) {
		errno = in->mode == IN_NONE ? ENOTSUP : EPIPE;
		return -1;
	}
	if (in->plen + len > 16 * MAX_FRAME) {
		errno = EAGAIN;
		return -1;
	}
	char *p = realloc(in->pending, in->plen + len);
	if (!p && in->plen + len) {
		errno = ENOMEM;
		return -1;
	}
	memcpy(p + in->plen, data, len);
	in->pending = p;
	in->plen += len;
	return 0;
}

/* Write what the command will take now; never block, or the shim would stop forwarding its
 * output while it waits for us to read. */
static void flush_input(struct input *in, int owns_fd)
{
	while (in->fd >= 0 && in->plen) {
		ssize_t n = write(in->fd, in->pending, in->plen);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN)
				return;
			in->plen = 0; /* the reader is gone */
			break;
		}
		memmove(in->pending, in->pending + n, in->plen - (size_t)n);
		in->plen -= (size_t)n;
	}
	if (in->fd >= 0 && in->close_after && !in->plen) {
		if (in->mode == IN_PTY) {
			/* A terminal's end of input is its EOF character, not a hang-up. */
			char eof = 4;
			(void)!write(in->fd, &eof, 1);
			in->close_after = 0;
		} else if (owns_fd) {
			close(in->fd);
			in->fd = -1;
		}
	}
}

/* A stream of frames read from one socket. */
struct framebuf {
	int fd;
	char *buf;
	size_t len;
};

/* One frame a client sent ('I', 'C' or 'R'); returns 0, or -1 with errno for 'F'. */
static int apply_frame(struct input *in, char type, const char *data, uint32_t len)
{
	switch (type) {
	case 'I':
		return queue_input(in, data, len);
	case 'C':
		if (in->mode == IN_NONE || in->fd < 0) {
			errno = in->mode == IN_NONE ? ENOTSUP : EPIPE;
			return -1;
		}
		in->close_after = 1;
		return 0;
	case 'R': {
		char text[64];
		snprintf(text, sizeof(text), "%.*s", (int)(len < 63 ? len : 63), data);
		return resize(in, text);
	}
	default:
		errno = EINVAL;
		return -1;
	}
}

/* Read what arrived; apply each complete frame, acknowledging it when `ack`. Returns -1 when
 * the peer hung up or broke the protocol. */
static int pump_frames(struct framebuf *fb, struct input *in, int ack)
{
	char chunk[65536];
	ssize_t n = recv(fb->fd, chunk, sizeof(chunk), MSG_DONTWAIT);
	if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
		return -1;
	if (n < 0)
		return 0;
	char *p = realloc(fb->buf, fb->len + (size_t)n);
	if (!p)
		return -1;
	memcpy(p + fb->len, chunk, (size_t)n);
	fb->buf = p;
	fb->len += (size_t)n;
	size_t off = 0;
	while (fb->len - off >= 5) {
		unsigned char *h = (unsigned char *)fb->buf + off;
		uint32_t flen = h[1] | (h[2] << 8) | (h[3] << 16) | ((uint32_t)h[4] << 24);
		if (flen > MAX_FRAME)
			return -1;
		if (fb->len - off < 5 + flen)
			break;
		int rc = apply_frame(in, (char)h[0], fb->buf + off + 5, flen);
		if (ack) {
			if (rc == 0)
				send_text(fb->fd, 'X', "0");
			else
				send_text(fb->fd, 'F', "%s", strerror(errno));
		}
		off += 5 + flen;
	}
	memmove(fb->buf, fb->buf + off, fb->len - off);
	fb->len -= off;
	return 0;
}

static int listen_io(pid_t pid, char *path, size_t plen)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	mkdir(IO_DIR, 0700);
	snprintf(path, plen, IO_DIR "/%d", (int)pid);
	unlink(path);
	snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0 || listen(fd, 16) < 0) {
		if (fd >= 0)
			close(fd);
		path[0] = '\0';
		return -1;
	}
	return fd;
}

/*
 * Fork the command. The child gets its own process group (a terminal: its own session)
 * so that a timeout can kill everything it started in the foreground. An exec failure
 * travels back over a CLOEXEC pipe, so the caller learns ENOENT for a missing binary or
 * bad cwd instead of a bare exit code.
 */
static pid_t start_command(struct request *rq, struct input *in, int out_fd, int err_fd, char *errbuf,
			   size_t errlen)
{
	int ep[2], inp[2] = {-1, -1};
	if (pipe2(ep, O_CLOEXEC) < 0) {
		snprintf(errbuf, errlen, "pipe: %s", strerror(errno));
		return -1;
	}
	if (in->mode == IN_PIPE && pipe2(inp, O_CLOEXEC) < 0) {
		snprintf(errbuf, errlen, "pipe: %s", strerror(errno));
		close(ep[0]);
		close(ep[1]);
		return -1;
	}
	if (in->mode == IN_PTY) {
		struct winsize ws = {.ws_row = in->rows, .ws_col = in->cols};
		in->fd = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
		if (in->fd < 0 || unlockpt(in->fd) < 0 || ptsname_r(in->fd, in->slave, sizeof(in->slave)) != 0 ||
		    ioctl(in->fd, TIOCSWINSZ, &ws) < 0) {
			snprintf(errbuf, errlen, "pty: %s", strerror(errno));
			if (in->fd >= 0)
				close(in->fd);
			in->fd = -1;
			close(ep[0]);
			close(ep[1]);
			return -1;
		}
	}
	pid_t pid = fork();
	if (pid < 0) {
		snprintf(errbuf, errlen, "fork: %s", strerror(errno));
		close(ep[0]);
		close(ep[1]);
		if (inp[0] >= 0) {
			close(inp[0]);
			close(inp[1]);
		}
		return -1;
	}
	if (pid == 0) {
		int stage = 0;
		close(ep[0]);
		if (in->mode == IN_PTY) {
			int slave;
			if (setsid() < 0 || (slave = open(in->slave, O_RDWR)) < 0 || ioctl(slave, TIOCSCTTY, 0) < 0 ||
			    dup2(slave, 0) < 0 || dup2(slave, 1) < 0 || dup2(slave, 2) < 0)
				goto fail;
			if (slave > 2)
				close(slave);
		} else {
			setpgid(0, 0);
			int in_fd = in->mode == IN_PIPE ? inp[0] : open("/dev/null", O_RDONLY);
			if (in_fd < 0 || dup2(in_fd, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0)
				goto fail;
		}
		stage = 3;
		if (rq->user && switch_user(rq->user) < 0)
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
	if (in->mode == IN_PIPE) {
		close(inp[0]);
		in->fd = inp[1];
	}
	if (in->fd >= 0)
		set_nonblock(in->fd);
	int e[2];
	if (read_all(ep[0], e, sizeof(e)) == 0) {
		const char *what = e[1] == 1 ? "cwd" : e[1] == 2 ? "exec" : e[1] == 3 ? "user" : "stdio";
		snprintf(errbuf, errlen, "%s %s: %s", what,
			 e[1] == 1 ? rq->cwd : e[1] == 2 ? rq->argv[0] : e[1] == 3 ? rq->user : "",
			 strerror(e[0]));
		close(ep[0]);
		waitpid(pid, NULL, 0);
		if (in->fd >= 0)
			close(in->fd);
		in->fd = -1;
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

/* How long output is still forwarded after the command exits (see supervise). */
#define EXIT_QUIET_MS 50
#define EXIT_GRACE_MS 250

/*
 * What a shim watches while its command runs.
 *   client: the foreground caller's connection (frames out, input frames in), or -1.
 *   outs:   read ends of the command's stdout/stderr to forward (-1 where none); a terminal's
 *           master is outs[0].
 *   sink:   where a background terminal's output goes (its stdout file), or -1.
 */
struct watch {
	pid_t pid;
	int client;
	int outs[2];
	int sink;
	struct input *in;
	int listen_fd;
	struct framebuf peers[MAX_IO_CLIENTS];
	struct framebuf client_frames;
};

static void drop_client(struct watch *w)
{
	close(w->client);
	w->client = -1;
	free(w->client_frames.buf);
	w->client_frames = (struct framebuf){.fd = -1};
}

static void kill_command(pid_t pid)
{
	kill(-pid, SIGKILL);
	kill(pid, SIGKILL);
}

/* Runs until the command has exited and its output is forwarded; returns its wait status. */
static int supervise(struct watch *w)
{
	int pidfd = (int)syscall(SYS_pidfd_open, w->pid, 0);
	int status = 0, exited = 0;
	long long exited_at = 0;
	char buf[65536];
	for (int i = 0; i < MAX_IO_CLIENTS; i++)
		w->peers[i].fd = -1;
	w->client_frames.fd = w->client;
	while (!exited || w->outs[0] >= 0 || w->outs[1] >= 0) {
		struct pollfd pf[6 + MAX_IO_CLIENTS];
		int m = 0, idx_out[2] = {-1, -1}, idx_pid = -1, idx_client = -1, idx_listen = -1, idx_in = -1;
		int idx_peer[MAX_IO_CLIENTS];
		for (int k = 0; k < 2; k++)
			if (w->outs[k] >= 0)
				idx_out[k] = m, pf[m++] = (struct pollfd){.fd = w->outs[k], .events = POLLIN};
		if (!exited && pidfd >= 0)
			idx_pid = m, pf[m++] = (struct pollfd){.fd = pidfd, .events = POLLIN};
		if (w->client >= 0)
			idx_client = m, pf[m++] = (struct pollfd){.fd = w->client, .events = POLLIN | POLLRDHUP};
		if (w->listen_fd >= 0 && !exited)
			idx_listen = m, pf[m++] = (struct pollfd){.fd = w->listen_fd, .events = POLLIN};
		if (w->in->fd >= 0 && w->in->plen)
			idx_in = m, pf[m++] = (struct pollfd){.fd = w->in->fd, .events = POLLOUT};
		for (int i = 0; i < MAX_IO_CLIENTS; i++) {
			idx_peer[i] = -1;
			if (w->peers[i].fd >= 0)
				idx_peer[i] = m, pf[m++] = (struct pollfd){.fd = w->peers[i].fd, .events = POLLIN};
		}
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
		if (idx_client >= 0 && (pf[idx_client].revents & (POLLIN | POLLHUP | POLLRDHUP | POLLERR))) {
			if (pump_frames(&w->client_frames, w->in, 0) < 0) {
				/* Client gone (timeout or crash): the foreground job dies with it. The
				 * connection goes first, so a client waiting for our EOF is released
				 * before the job has finished dying. */
				drop_client(w);
				kill_command(w->pid);
			}
		}
		if (idx_listen >= 0 && (pf[idx_listen].revents & POLLIN)) {
			int c = accept4(w->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
			if (c >= 0) {
				int slot = -1;
				for (int i = 0; i < MAX_IO_CLIENTS && slot < 0; i++)
					if (w->peers[i].fd < 0)
						slot = i;
				if (slot < 0)
					close(c);
				else
					w->peers[slot] = (struct framebuf){.fd = c};
			}
		}
		for (int i = 0; i < MAX_IO_CLIENTS; i++) {
			if (idx_peer[i] < 0 || !pf[idx_peer[i]].revents)
				continue;
			if (pump_frames(&w->peers[i], w->in, 1) < 0) {
				close(w->peers[i].fd);
				free(w->peers[i].buf);
				w->peers[i] = (struct framebuf){.fd = -1};
			}
		}
		/* idx_in's POLLOUT only wakes the loop: whatever the command takes now is written. */
		(void)idx_in;
		flush_input(w->in, 1);
		for (int k = 0; k < 2; k++) {
			int idx = idx_out[k];
			if (idx < 0 || !pf[idx].revents)
				continue;
			ssize_t n = read(w->outs[k], buf, sizeof(buf));
			if (n < 0 && (errno == EAGAIN || errno == EINTR))
				continue;
			if (n <= 0) {
				/* A terminal's master reads EIO once every slave is closed. */
				if (w->in->mode == IN_PTY && k == 0)
					w->in->fd = -1;
				close(w->outs[k]);
				w->outs[k] = -1;
			} else if (w->sink >= 0) {
				write_all(w->sink, buf, (size_t)n);
			} else if (w->client >= 0 && send_frame(w->client, k == 0 ? 'O' : 'E', buf, (uint32_t)n) < 0) {
				drop_client(w);
				kill_command(w->pid);
			}
		}
		if ((idx_pid >= 0 && pf[idx_pid].revents) || (pidfd < 0 && !exited)) {
			if (waitpid(w->pid, &status, pidfd < 0 ? WNOHANG : 0) == w->pid)
				exited = 1, exited_at = now_ms();
		}
	}
	if (!exited)
		waitpid(w->pid, &status, 0);
	if (pidfd >= 0)
		close(pidfd);
	for (int i = 0; i < MAX_IO_CLIENTS; i++)
		if (w->peers[i].fd >= 0)
			close(w->peers[i].fd);
	return status;
}

static int start_input(struct request *rq, struct input *in, int conn)
{
	if (parse_input(rq->input, in) < 0) {
		send_text(conn, 'F', "EINVAL input must be 'pipe' or 'pty:ROWS:COLS'");
		return -1;
	}
	return 0;
}

static void stop_input(struct input *in, int listen_fd, const char *path)
{
	if (listen_fd >= 0) {
		close(listen_fd);
		unlink(path);
	}
	if (in->mode == IN_PIPE && in->fd >= 0)
		close(in->fd);
	free(in->pending);
}

/* The request that started each running command, as /.bunshin/procs/<pid>: what
 * commands.list() reports (E2B lists a command's configuration, not what it exec'd into). */
static const char *raw_request;
static uint32_t raw_length;

static void proc_path(char *buf, size_t len, pid_t pid)
{
	snprintf(buf, len, PROCS_DIR "/%d", (int)pid);
}

static void record_command(pid_t pid)
{
	char path[64], tmp[80];
	mkdir(PROCS_DIR, 0700);
	proc_path(path, sizeof(path), pid);
	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0)
		return;
	write_all(fd, raw_request, raw_length);
	close(fd);
	rename(tmp, path);
}

static void forget_command(pid_t pid)
{
	char path[64];
	proc_path(path, sizeof(path), pid);
	unlink(path);
}

static int op_run(int conn, struct request *rq)
{
	int op[2], ep[2];
	char err[512], io_path[64] = "";
	struct input in;
	if (rq->argc == 0)
		return send_text(conn, 'F', "EINVAL empty argv");
	if (start_input(rq, &in, conn) < 0)
		return 0;
	if (pipe2(op, O_CLOEXEC) < 0 || pipe2(ep, O_CLOEXEC) < 0)
		return send_text(conn, 'F', "pipe: %s", strerror(errno));
	pid_t pid = start_command(rq, &in, op[1], ep[1], err, sizeof(err));
	close(op[1]);
	close(ep[1]);
	if (pid < 0)
		return send_text(conn, 'F', "%s", err);
	record_command(pid);
	int listen_fd = in.mode != IN_NONE ? listen_io(pid, io_path, sizeof(io_path)) : -1;
	send_text(conn, 'P', "%d", pid);

	struct watch w = {.pid = pid, .client = conn, .outs = {op[0], ep[0]}, .sink = -1, .in = &in,
			  .listen_fd = listen_fd};
	if (in.mode == IN_PTY) {
		/* The terminal carries both streams; the pipes are left to nothing. */
		close(op[0]);
		close(ep[0]);
		w.outs[0] = dup(in.fd);
		w.outs[1] = -1;
	}
	int status = supervise(&w);
	forget_command(pid);
	if (w.client >= 0) {
		send_text(conn, 'X', "%d", status);
		close(conn);
	}
	stop_input(&in, listen_fd, io_path);
	if (in.mode == IN_PTY) {
		if (in.fd >= 0)
			close(in.fd);
		if (w.outs[0] >= 0)
			close(w.outs[0]);
		return 0;
	}
	/* Keep the read ends open for background processes that inherited the pipes,
	 * so they do not die of SIGPIPE; their output goes nowhere. */
	drain_discard(w.outs, 2);
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

/* Atomically, so a reader never sees a partial value. */
static void write_file_atomic(const char *dir, const char *name, const char *text)
{
	char tmp[200], path[200];
	snprintf(tmp, sizeof(tmp), "%s/%s.tmp", dir, name);
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd >= 0) {
		write_all(fd, text, strlen(text));
		close(fd);
		rename(tmp, path);
	}
}

static int op_spawn(int conn, struct request *rq)
{
	char dir[128], path[160], err[512], io_path[64] = "", text[32];
	struct input in;
	if (rq->argc == 0 || !valid_id(rq->id))
		return send_text(conn, 'F', "EINVAL spawn needs argv and an id of [a-z0-9-]");
	if (start_input(rq, &in, conn) < 0)
		return 0;
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
	pid_t pid = start_command(rq, &in, out, errf, err, sizeof(err));
	close(errf);
	if (pid < 0)
		return send_text(conn, 'F', "%s", err);
	record_command(pid);
	int listen_fd = in.mode != IN_NONE ? listen_io(pid, io_path, sizeof(io_path)) : -1;
	send_text(conn, 'P', "%d", pid);
	close(conn);
	int status;
	if (in.mode == IN_NONE) {
		close(out);
		while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
			;
	} else {
		struct watch w = {.pid = pid, .client = -1, .outs = {-1, -1}, .sink = -1, .in = &in,
				  .listen_fd = listen_fd};
		if (in.mode == IN_PTY) {
			w.outs[0] = dup(in.fd);
			w.sink = out;
		}
		status = supervise(&w);
		if (w.outs[0] >= 0)
			close(w.outs[0]);
		close(out);
		stop_input(&in, listen_fd, io_path);
		if (in.mode == IN_PTY && in.fd >= 0)
			close(in.fd);
	}
	forget_command(pid);
	snprintf(text, sizeof(text), "%d\n", status);
	write_file_atomic(dir, "exit", text);
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
	raw_request = buf;
	raw_length = len;
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

/* ---- lifetime ---- */

static long long wall_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

/* The lifetime, as the host writes it (process/lifetime.py: ADDRESS and the layout). CRIU
 * restores the page with the rest of the memory; the host rewrites it with a clone's (or a
 * resumed workspace's) own lifetime while CRIU still holds every task stopped (restore.py),
 * so a clone never obeys its source's. */
#define LIFETIME_ADDR 0x4E00000000UL
#define LIFE_MAGIC 0x4c6e6968736e7562ULL  /* "bunshinL" */
#define RENEW_MAGIC 0x526e6968736e7562ULL /* "bunshinR" */
/* How long a new init waits for its first lifetime: the host writes it as soon as the init
 * answers; a host that died first leaves a workspace that ends by itself. */
#define LIFE_GRACE_MS 30000

struct life_page {
	uint64_t magic;       /* LIFE_MAGIC once the host wrote a lifetime; 0 before */
	int64_t deadline_ms;  /* wall clock; 0: none */
	int64_t lease_ms;     /* 0: none */
	uint64_t check;       /* LIFE_MAGIC ^ deadline_ms ^ lease_ms */
	int64_t renewed_ms;   /* wall clock of the lease's last renewal by the host */
	uint64_t renew_check; /* RENEW_MAGIC ^ renewed_ms */
};

static volatile struct life_page *life;
static long long started_ms; /* monotonic: when this init started (the grace for a first lifetime) */

static int map_lifetime(void)
{
	void *p = mmap((void *)LIFETIME_ADDR, 4096, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
	if (p != (void *)LIFETIME_ADDR)
		return -1;
	life = p;
	started_ms = now_ms();
	return 0;
}

/* When the workspace must end (wall clock, ms): 0 for never, -1 for now. Read afresh on every
 * wake-up. A copy that does not check out is read again (the host may be writing it); one that
 * never does ends the workspace, as does no lifetime LIFE_GRACE_MS after the start, whose wait
 * is capped at the rest of the grace in *cap_ms. */
static long long lifetime_expiry(int *cap_ms)
{
	struct life_page p;
	*cap_ms = -1;
	for (int tries = 0;; tries++) {
		p.magic = life->magic;
		p.deadline_ms = life->deadline_ms;
		p.lease_ms = life->lease_ms;
		p.check = life->check;
		p.renewed_ms = life->renewed_ms;
		p.renew_check = life->renew_check;
		if (!p.magic && !p.check) {
			long long left = started_ms + LIFE_GRACE_MS - now_ms();
			if (left <= 0)
				return -1;
			*cap_ms = (int)left;
			return 0;
		}
		if (p.magic == LIFE_MAGIC && p.check == (LIFE_MAGIC ^ (uint64_t)p.deadline_ms ^ (uint64_t)p.lease_ms) &&
		    p.renew_check == (RENEW_MAGIC ^ (uint64_t)p.renewed_ms) && p.deadline_ms >= 0 && p.lease_ms >= 0)
			break;
		if (tries >= 500)
			return -1;
		struct timespec ts = {.tv_nsec = 20000};
		nanosleep(&ts, NULL);
	}
	long long expiry = p.deadline_ms;
	if (p.lease_ms > 0 && (!expiry || p.renewed_ms + p.lease_ms < expiry))
		expiry = p.renewed_ms + p.lease_ms;
	return expiry ? expiry : 0;
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
	/* Not dumpable: nothing in the workspace may ptrace this process, read its descriptors or
	 * write its memory (where its lifetime lives); its shims inherit this, and CRIU keeps it. */
	if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0 || map_lifetime() < 0)
		return 1;
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
	sigaddset(&mask, SIG_LIFETIME);
	for (size_t i = 0; i < sizeof(forwarded) / sizeof(forwarded[0]); i++)
		sigaddset(&mask, forwarded[i]);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
	int lfd = listen_ctl();
	if (sfd < 0 || lfd < 0)
		return 1;

	int terminating = 0;
	for (;;) {
		int cap_ms;
		long long expiry = lifetime_expiry(&cap_ms);
		int wait_ms = terminating ? 100 : -1;
		if (cap_ms >= 0 && (wait_ms < 0 || cap_ms < wait_ms))
			wait_ms = cap_ms;
		if (expiry) {
			long long left = expiry < 0 ? 0 : expiry - wall_ms();
			if (left <= 0) {
				/* The lifetime is over, or cannot be known: the namespace dies with its init. */
				kill(-1, SIGKILL);
				return 124;
			}
			if (wait_ms < 0 || left < wait_ms)
				wait_ms = left > 60000 ? 60000 : (int)left;
		}
		struct pollfd pf[2] = {{.fd = sfd, .events = POLLIN}, {.fd = lfd, .events = POLLIN}};
		int r = poll(pf, terminating ? 1 : 2, wait_ms);
		if (r < 0 && errno != EINTR)
			return 1;
		if (pf[0].revents & POLLIN) {
			struct signalfd_siginfo si;
			while (read(sfd, &si, sizeof(si)) == sizeof(si)) {
				if (si.ssi_signo == SIGCHLD || (int)si.ssi_signo == SIG_LIFETIME)
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
