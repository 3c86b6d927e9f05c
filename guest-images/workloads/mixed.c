/*
 * mixed: a little of everything a kernel does for a user: process creation, file I/O, pipes.
 *
 * usage: mixed [ITERATIONS]   (default 20)
 *
 * Each iteration: fork + exec of /bin/true and wait; write 64 KiB to a file, read it back and
 * compare; send 16 KiB through a pipe to a child that echoes it back through another pipe and
 * compare. Any mismatch or failure makes the exit code non-zero.
 * Prints EXOTAP-RESULT lines: mixed.iterations, mixed.forks, mixed.bytes_checked,
 * mixed.errors, mixed.ms.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define FILE_BYTES (64 * 1024)
#define PIPE_BYTES (16 * 1024)

static unsigned char pattern[FILE_BYTES], back[FILE_BYTES];

static long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static int full_write(int fd, const void *p, size_t n)
{
	const unsigned char *c = p;
	while (n) {
		ssize_t w = write(fd, c, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		c += w;
		n -= (size_t)w;
	}
	return 0;
}

static int full_read(int fd, void *p, size_t n)
{
	unsigned char *c = p;
	while (n) {
		ssize_t r = read(fd, c, n);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		c += r;
		n -= (size_t)r;
	}
	return 0;
}

static int fork_exec_true(void)
{
	int status;
	pid_t pid = fork();
	if (pid < 0)
		return -1;
	if (pid == 0) {
		execl("/bin/true", "true", (char *)NULL);
		_exit(127);
	}
	if (waitpid(pid, &status, 0) != pid)
		return -1;
	return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -1;
}

static int file_round_trip(int iter)
{
	const char *path = "/tmp/mixed.dat";
	int fd, ok;
	memset(back, 0, sizeof(back));
	fd = open(path, O_CREAT | O_TRUNC | O_RDWR, 0644);
	if (fd < 0)
		return -1;
	pattern[0] = (unsigned char)iter;
	ok = full_write(fd, pattern, FILE_BYTES) == 0 && lseek(fd, 0, SEEK_SET) == 0 &&
	     full_read(fd, back, FILE_BYTES) == 0 && memcmp(pattern, back, FILE_BYTES) == 0;
	close(fd);
	unlink(path);
	return ok ? 0 : -1;
}

static int pipe_round_trip(void)
{
	int to_child[2], to_parent[2], status, ok;
	pid_t pid;
	if (pipe(to_child) || pipe(to_parent))
		return -1;
	pid = fork();
	if (pid < 0)
		return -1;
	if (pid == 0) {
		static unsigned char buf[PIPE_BYTES];
		close(to_child[1]);
		close(to_parent[0]);
		if (full_read(to_child[0], buf, PIPE_BYTES) || full_write(to_parent[1], buf, PIPE_BYTES))
			_exit(1);
		_exit(0);
	}
	close(to_child[0]);
	close(to_parent[1]);
	memset(back, 0, PIPE_BYTES);
	ok = full_write(to_child[1], pattern, PIPE_BYTES) == 0 &&
	     full_read(to_parent[0], back, PIPE_BYTES) == 0 && memcmp(pattern, back, PIPE_BYTES) == 0;
	close(to_child[1]);
	close(to_parent[0]);
	if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
		ok = 0;
	return ok ? 0 : -1;
}

int main(int argc, char **argv)
{
	long iterations = argc > 1 ? strtol(argv[1], NULL, 10) : 20;
	long i, errors = 0, forks = 0, checked = 0;
	long long t0 = now_ms();

	if (iterations <= 0) {
		fprintf(stderr, "mixed: ITERATIONS must be a positive number\n");
		return 2;
	}
	for (i = 0; i < FILE_BYTES; i++)
		pattern[i] = (unsigned char)(i * 131 + 7);
	for (i = 0; i < iterations; i++) {
		if (fork_exec_true() == 0)
			forks++;
		else
			errors++;
		if (file_round_trip((int)i) == 0)
			checked += FILE_BYTES;
		else
			errors++;
		if (pipe_round_trip() == 0)
			checked += PIPE_BYTES;
		else
			errors++;
	}
	printf("EXOTAP-RESULT mixed.iterations=%ld\n", iterations);
	printf("EXOTAP-RESULT mixed.forks=%ld\n", forks);
	printf("EXOTAP-RESULT mixed.bytes_checked=%ld\n", checked);
	printf("EXOTAP-RESULT mixed.errors=%ld\n", errors);
	printf("EXOTAP-RESULT mixed.ms=%lld\n", now_ms() - t0);
	return errors ? 1 : 0;
}
