/*
 * What both mini-kernels share, included by x86_64/kernel.c and sparc64/kernel.c: the
 * types, the string and memory helpers and everything up to the binary search tree's
 * storage. The two kernels differ from there on (SPARC bounds its recursion depth).
 */
typedef unsigned long u64;
typedef unsigned int u32;
typedef unsigned char u8;
typedef long s64;

#define noinline __attribute__((noinline))
#define NULL ((void *)0)

u64 exotap_result;

/* ---- string and memory helpers (loops, leaf functions) ---- */

noinline void *memset(void *dst, int c, u64 n)
{
    u8 *d = dst;
    while (n--)
        *d++ = (u8)c;
    return dst;
}

noinline void *memcpy(void *dst, const void *src, u64 n)
{
    u8 *d = dst;
    const u8 *s = src;
    while (n--)
        *d++ = *s++;
    return dst;
}

noinline u64 strlen(const char *s)
{
    const char *p = s;
    while (*p)
        p++;
    return (u64)(p - s);
}

noinline int strcmp(const char *a, const char *b)
{
    while (*a && *a == *b) {
        a++;
        b++;
    }
    return (int)(u8)*a - (int)(u8)*b;
}

/* ---- checksum ---- */

static u32 crc_table[256];

noinline void crc32_init(void)
{
    for (u32 i = 0; i < 256; i++) {
        u32 c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

noinline u32 crc32(u32 crc, const void *buf, u64 len)
{
    const u8 *p = buf;
    crc = ~crc;
    while (len--)
        crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

noinline u64 mix(u64 h, u64 v)
{
    h ^= v + 0x9e3779b97f4a7c15ul + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdul;
}

/* ---- linked lists (list_head) ---- */

struct list_head {
    struct list_head *next, *prev;
};

static inline void list_init(struct list_head *h)
{
    h->next = h;
    h->prev = h;
}

noinline void list_add_tail(struct list_head *n, struct list_head *h)
{
    struct list_head *prev = h->prev;
    n->next = h;
    n->prev = prev;
    prev->next = n;
    h->prev = n;
}

noinline void list_del(struct list_head *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->next = NULL;
    n->prev = NULL;
}

#define container_of(ptr, type, member) \
    ((type *)((char *)(ptr) - __builtin_offsetof(type, member)))

struct task {
    int pid;
    int prio;
    u64 runtime;
    char comm[16];
    struct list_head node;
};

#define MAX_TASKS 32
static struct task tasks[MAX_TASKS];
static int ntasks;
static struct list_head runqueue;

noinline struct task *task_create(const char *comm, int prio)
{
    if (ntasks >= MAX_TASKS)
        return NULL;
    struct task *t = &tasks[ntasks];
    t->pid = 100 + ntasks;
    t->prio = prio;
    t->runtime = 0;
    u64 n = strlen(comm);
    if (n > 15)
        n = 15;
    memcpy(t->comm, comm, n);
    t->comm[n] = 0;
    ntasks++;
    /* keep the run queue sorted by priority */
    struct list_head *pos = runqueue.next;
    while (pos != &runqueue && container_of(pos, struct task, node)->prio <= prio)
        pos = pos->next;
    list_add_tail(&t->node, pos);
    return t;
}

noinline struct task *pick_next(void)
{
    if (runqueue.next == &runqueue)
        return NULL;
    return container_of(runqueue.next, struct task, node);
}

noinline void schedule_tick(u64 slice)
{
    struct task *t = pick_next();
    if (!t)
        return;
    t->runtime += slice;
    list_del(&t->node);
    t->prio += (int)(slice & 3) + 1;
    struct list_head *pos = runqueue.next;
    while (pos != &runqueue && container_of(pos, struct task, node)->prio <= t->prio)
        pos = pos->next;
    list_add_tail(&t->node, pos);
}

noinline struct task *find_task(const char *comm)
{
    for (struct list_head *p = runqueue.next; p != &runqueue; p = p->next) {
        struct task *t = container_of(p, struct task, node);
        if (!strcmp(t->comm, comm))
            return t;
    }
    return NULL;
}

/* ---- devices: structs with function-pointer members ---- */

struct file;
struct file_operations {
    s64 (*read)(struct file *f, u8 *buf, u64 len);
    s64 (*write)(struct file *f, const u8 *buf, u64 len);
    s64 (*ioctl)(struct file *f, u32 cmd, u64 arg);
};

struct file {
    const struct file_operations *f_op;
    u64 pos;
    u8 data[256];
    u64 size;
};

static s64 ramfs_read(struct file *f, u8 *buf, u64 len)
{
    if (f->pos >= f->size)
        return 0;
    if (len > f->size - f->pos)
        len = f->size - f->pos;
    memcpy(buf, f->data + f->pos, len);
    f->pos += len;
    return (s64)len;
}

static s64 ramfs_write(struct file *f, const u8 *buf, u64 len)
{
    if (f->pos + len > sizeof(f->data))
        len = sizeof(f->data) - f->pos;
    memcpy(f->data + f->pos, buf, len);
    f->pos += len;
    if (f->pos > f->size)
        f->size = f->pos;
    return (s64)len;
}

static s64 ramfs_ioctl(struct file *f, u32 cmd, u64 arg)
{
    switch (cmd) {
    case 1:
        f->pos = arg < f->size ? arg : f->size;
        return (s64)f->pos;
    case 2:
        return (s64)f->size;
    case 3:
        return crc32(0, f->data, f->size);
    default:
        return -22;
    }
}

static s64 zero_read(struct file *f, u8 *buf, u64 len)
{
    (void)f;
    memset(buf, 0, len);
    return (s64)len;
}

static s64 null_write(struct file *f, const u8 *buf, u64 len)
{
    (void)buf;
    f->pos += len;
    return (s64)len;
}

static s64 bad_ioctl(struct file *f, u32 cmd, u64 arg)
{
    (void)f;
    (void)cmd;
    (void)arg;
    return -25;
}

static const struct file_operations ramfs_fops = { ramfs_read, ramfs_write, ramfs_ioctl };
static const struct file_operations zero_fops = { zero_read, null_write, bad_ioctl };

#define NFILES 4
static struct file files[NFILES];

/* ---- binary search tree (recursion) ---- */

struct tnode {
    u64 key;
    u64 val;
    struct tnode *left, *right;
};

#define MAX_NODES 64
static struct tnode nodes[MAX_NODES];
static int nnodes;

