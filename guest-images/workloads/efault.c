/*
 * efault: read() into an unmapped buffer must fail with EFAULT (the kernel's user-copy
 * fault fixup, found by the faulting instruction's address in its exception table).
 *
 * usage: efault KEY FILE...
 * For each FILE prints EXOTAP-RESULT efault.KEY.<n>=<return value>/<errno> (n from 0), and
 * exits 0 when every read returned -1 with EFAULT.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	int i, bad = 0;

	if (argc < 3) {
		fprintf(stderr, "usage: efault KEY FILE...\n");
		return 2;
	}
	for (i = 2; i < argc; i++) {
		void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		int fd = open(argv[i], O_RDONLY);
		ssize_t r;

		if (p == MAP_FAILED || fd < 0 || munmap(p, 4096) != 0) {
			perror("efault: setup");
			return 2;
		}
		errno = 0;
		r = read(fd, p, 64);
		printf("EXOTAP-RESULT efault.%s.%d=%zd/%d\n", argv[1], i - 2, r, errno);
		if (r != -1 || errno != EFAULT)
			bad = 1;
		close(fd);
	}
	return bad;
}
