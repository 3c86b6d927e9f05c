/*
 * syscall-loop: a fixed number of cheap system calls, each timed by the guest itself.
 *
 * usage: syscall-loop [COUNT [CALL...]]   (COUNT 100000 by default)
 *
 * Makes exactly COUNT calls of each CALL: getpid, getppid, open_close (open+close of a small
 * file), pread (of that file) and read (18 bytes of /dev/zero, through ksys_read). Without
 * CALLs: the first four, in that order. So a host-side probe count can be compared with COUNT
 * exactly. Calls go through syscall(2) so libc caching can never skip the kernel.
 * Prints EXOTAP-RESULT lines: <call>.calls, <call>.ns_per_call, and getppid.value (the value
 * the kernel returned last, so a nullified getppid shows).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static const char *small_file = "/tmp/syscall-loop.small";

static long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void report(const char *name, long count, long long ns)
{
	printf("EXOTAP-RESULT %s.calls=%ld\n", name, count);
	printf("EXOTAP-RESULT %s.ns_per_call=%lld\n", name, count ? ns / count : 0);
}

static const char *const calls[] = { "getpid", "getppid", "open_close", "pread", "read" };
#define NCALLS (sizeof(calls) / sizeof(calls[0]))

/* Which calls the command line asks for: the first four when it names none. */
static bool parse_calls(int argc, char **argv, bool want[NCALLS])
{
	size_t c;
	int a;

	for (c = 0; c < NCALLS; c++)
		want[c] = argc <= 2 && c < 4;
	for (a = 2; a < argc; a++) {
		for (c = 0; c < NCALLS && strcmp(argv[a], calls[c]) != 0; c++)
			;
		if (c == NCALLS) {
			fprintf(stderr, "syscall-loop: unknown call '%s' (getpid, getppid, "
					"open_close, pread, read)\n", argv[a]);
			return false;
		}
		want[c] = true;
	}
	return true;
}

int main(int argc, char **argv)
{
	long count = argc > 1 ? strtol(argv[1], NULL, 10) : 100000;
	long long t0, t1;
	long i, ppid = 0, sum = 0;
	char buf[64];
	bool want[NCALLS];
	int fd;

	if (count <= 0) {
		fprintf(stderr, "syscall-loop: COUNT must be a positive number\n");
		return 2;
	}
	if (!parse_calls(argc, argv, want))
		return 2;
	fd = open(small_file, O_CREAT | O_TRUNC | O_WRONLY, 0644);
	if (fd < 0 || write(fd, "exotap small file\n", 18) != 18 || close(fd) != 0) {
		perror("syscall-loop: cannot create the small file");
		return 1;
	}

	if (want[0]) {
		t0 = now_ns();
		for (i = 0; i < count; i++)
			sum += syscall(SYS_getpid);
		t1 = now_ns();
		report("getpid", count, t1 - t0);
	}

	if (want[1]) {
		t0 = now_ns();
		for (i = 0; i < count; i++)
			ppid = syscall(SYS_getppid);
		t1 = now_ns();
		report("getppid", count, t1 - t0);
		printf("EXOTAP-RESULT getppid.value=%ld\n", ppid);
	}

	if (want[2]) {
		t0 = now_ns();
		for (i = 0; i < count; i++) {
			fd = syscall(SYS_open, small_file, O_RDONLY);
			if (fd < 0 || syscall(SYS_close, fd) != 0) {
				perror("syscall-loop: open/close");
				return 1;
			}
		}
		t1 = now_ns();
		report("open_close", count, t1 - t0);
	}

	if (want[3]) {
		fd = open(small_file, O_RDONLY);
		if (fd < 0) {
			perror("syscall-loop: open");
			return 1;
		}
		t0 = now_ns();
		for (i = 0; i < count; i++) {
			if (syscall(SYS_pread64, fd, buf, sizeof(buf), 0) != 18) {
				perror("syscall-loop: pread");
				return 1;
			}
		}
		t1 = now_ns();
		close(fd);
		report("pread", count, t1 - t0);
	}

	if (want[4]) {
		fd = open("/dev/zero", O_RDONLY);
		if (fd < 0) {
			perror("syscall-loop: open /dev/zero");
			return 1;
		}
		t0 = now_ns();
		for (i = 0; i < count; i++) {
			if (syscall(SYS_read, fd, buf, 18) != 18) {
				perror("syscall-loop: read");
				return 1;
			}
		}
		t1 = now_ns();
		close(fd);
		report("read", count, t1 - t0);
	}
	if (want[0])
		printf("EXOTAP-RESULT getpid.value=%ld\n", count ? sum / count : 0);
	return 0;
}
