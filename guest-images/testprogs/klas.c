/* Ground truth for exotap's KLAS join points (introspect/src/dwarf/klas): built by the tests
 * with `gcc -g -O2 -static -no-pie`, run under ptrace single-stepping, and every executed
 * access to a `struct obj` or `struct ops` instance is compared with the statically found
 * member-access sites. Accesses come in the shapes kernel code has: through parameters,
 * copies, loads of pointer members (o->next->pos), embedded members (&o->in), arrays of
 * structs, bitfields, read-modify-write, inlined helpers, and calls through function-pointer
 * members (o->ops->read(...)). */

struct obj;

struct ops {
	int (*open)(struct obj *o);
	long (*read)(struct obj *o, long n);
	void (*release)(struct obj *o);
};

struct inner {
	long a;
	long b;
};

struct obj {
	long pos;
	int flags;
	unsigned int mode : 3;
	unsigned int dirty : 1;
	struct inner in;
	const struct ops *ops;
	struct obj *next;
	char name[16];
	long count;
};

#define NOBJ 8
struct obj objs[NOBJ];
volatile long sink;

static int obj_open(struct obj *o)
{
	o->flags |= 1;
	o->mode = 3;
	return o->flags;
}

static long obj_read(struct obj *o, long n)
{
	long p = o->pos;
	o->pos = p + n;
	o->count++;
	return p;
}

static void obj_release(struct obj *o)
{
	o->flags = 0;
	o->dirty = 0;
}

static long other_read(struct obj *o, long n)
{
	o->in.b += n;
	return o->in.a;
}

const struct ops ops_a = { obj_open, obj_read, obj_release };
const struct ops ops_b = { obj_open, other_read, obj_release };

static inline long inner_sum(const struct inner *in)
{
	return in->a + in->b;
}

__attribute__((noinline)) long walk_list(struct obj *head)
{
	long total = 0;
	for (struct obj *o = head; o; o = o->next)
		total += o->pos + inner_sum(&o->in);
	return total;
}

__attribute__((noinline)) long do_read(struct obj *o, long n)
{
	if (o->ops->open(o) < 0)
		return -1;
	long r = o->ops->read(o, n);
	o->ops->release(o);
	return r;
}

__attribute__((noinline)) void touch_inner(struct inner *in, long v)
{
	in->a = v;
	in->b ^= v;
}

__attribute__((noinline)) void mark_all(long n)
{
	for (long i = 0; i < n; i++) {
		objs[i].dirty = 1;
		objs[i].count += i;
	}
}

__attribute__((noinline)) int name_len(const struct obj *o)
{
	int len = 0;
	while (len < 16 && o->name[len])
		len++;
	return len;
}

__attribute__((noinline)) long chase(struct obj *o)
{
	struct obj *second = o->next;
	long v = second->pos;
	second->next->count = v;
	return second->next->flags;
}

int main(void)
{
	for (int i = 0; i < NOBJ; i++) {
		objs[i].ops = (i & 1) ? &ops_b : &ops_a;
		objs[i].next = i + 1 < NOBJ ? &objs[i + 1] : 0;
		objs[i].name[0] = 'a' + i;
		objs[i].in.a = i;
	}
	for (int round = 0; round < 3; round++) {
		for (int i = 0; i < NOBJ; i++) {
			sink += do_read(&objs[i], round + 1);
			touch_inner(&objs[i].in, round);
			sink += name_len(&objs[i]);
		}
		mark_all(NOBJ);
		sink += walk_list(&objs[0]);
		sink += chase(&objs[round]);
	}
	return (int)(sink & 0x7f) == 0x7f;
}
