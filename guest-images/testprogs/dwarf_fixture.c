/* Fixture of exotap's DWARF reader tests (introspect/src/dwarf): built by the tests with
 * `gcc -g -O2`, never committed as a binary. The line numbers below are asserted by the
 * tests: keep them when editing (add new code at the end). */
#include <stdio.h>

struct list_head {
	struct list_head *next, *prev;
};

typedef int pid_t;

struct task {
	pid_t pid;
	char comm[16];
	struct list_head tasks;
	union {
		int a;
		long b;
	};
	unsigned int flags : 3;
	unsigned int state : 5;
	int (*fn)(struct task *, const char *);
	int matrix[2][3];
	const volatile unsigned long *cv;
};

enum color { RED, GREEN = 5, BLUE };

struct task global_task;
enum color global_color = BLUE;

__attribute__((noinline)) int task_pid(const struct task *t)
{
	return t->pid;
}

static inline int twice(int x)
{
	return x * 2;
}

__attribute__((noinline)) int sum_pids(struct task *t, int n)
{
	int total = 0;
	for (int i = 0; i < n; i++)
		total += twice(task_pid(&t[i]));
	return total;
}

static int say(struct task *t, const char *what)
{
	return printf("%s %s\n", t->comm, what);
}

int main(int argc, char **argv)
{
	(void)argv;
	global_task.pid = argc;
	global_task.fn = say;
	global_task.fn(&global_task, "hello");
	return sum_pids(&global_task, 1) + (int)global_color;
}
