/*
 * The x86-64 mini-kernel: kernel-shaped code for exotap's splicing-safety regression.
 *
 * Built freestanding with -pg -mfentry -mnop-mcount (a 5-byte nop at every function
 * entry, like an ftrace-enabled kernel), -mcmodel=kernel and -mno-red-zone. It has no
 * input: kmain runs a fixed script of "system calls" through a table of function
 * pointers, over devices with file_operations-like structs of function pointers, a task
 * list, a binary search tree, a hash table and a bytecode interpreter (a dense switch,
 * compiled to a jump table), and returns a checksum of everything it computed. Results
 * also stay in memory (.data/.bss), which the regression compares too.
 */
#include "common.h"

noinline struct tnode *tree_insert(struct tnode *root, u64 key, u64 val)
{
    if (!root) {
        if (nnodes >= MAX_NODES)
            return NULL;
        struct tnode *n = &nodes[nnodes++];
        n->key = key;
        n->val = val;
        n->left = n->right = NULL;
        return n;
    }
    if (key < root->key)
        root->left = tree_insert(root->left, key, val);
    else if (key > root->key)
        root->right = tree_insert(root->right, key, val);
    else
        root->val += val;
    return root;
}

noinline u64 tree_sum(const struct tnode *n, int depth)
{
    if (!n)
        return 0;
    return n->val * (u64)(depth + 1) + tree_sum(n->left, depth + 1) + tree_sum(n->right, depth + 1);
}

noinline int tree_height(const struct tnode *n)
{
    if (!n)
        return 0;
    int l = tree_height(n->left);
    int r = tree_height(n->right);
    return 1 + (l > r ? l : r);
}

noinline u64 fib(u32 n)
{
    return n < 2 ? n : fib(n - 1) + fib(n - 2);
}

noinline u64 gcd(u64 a, u64 b)
{
    /* written recursively; gcc turns the self tail call into a loop */
    return b ? gcd(b, a % b) : a;
}

noinline void sort(u64 *a, s64 lo, s64 hi)
{
    while (lo < hi) {
        u64 pivot = a[(lo + hi) / 2];
        s64 i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot)
                i++;
            while (a[j] > pivot)
                j--;
            if (i <= j) {
                u64 t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (j - lo < hi - i) {
            sort(a, lo, j);
            lo = i;
        } else {
            sort(a, i, hi);
            hi = j;
        }
    }
}

/* ---- a bytecode interpreter: a dense switch becomes a jump table ---- */

enum op { OP_PUSH, OP_ADD, OP_SUB, OP_MUL, OP_DUP, OP_SWAP, OP_JNZ, OP_DEC, OP_XOR, OP_SHL, OP_HALT };

noinline u64 interp(const u8 *code, u64 len)
{
    u64 stack[16];
    int sp = 0;
    u64 pc = 0;
    u64 steps = 0;
    while (pc < len && steps < 10000) {
        steps++;
        u8 op = code[pc++];
        switch (op) {
        case OP_PUSH:
            if (sp < 16)
                stack[sp++] = code[pc];
            pc++;
            break;
        case OP_ADD:
            if (sp >= 2) { stack[sp - 2] += stack[sp - 1]; sp--; }
            break;
        case OP_SUB:
            if (sp >= 2) { stack[sp - 2] -= stack[sp - 1]; sp--; }
            break;
        case OP_MUL:
            if (sp >= 2) { stack[sp - 2] *= stack[sp - 1]; sp--; }
            break;
        case OP_DUP:
            if (sp >= 1 && sp < 16) { stack[sp] = stack[sp - 1]; sp++; }
            break;
        case OP_SWAP:
            if (sp >= 2) { u64 t = stack[sp - 1]; stack[sp - 1] = stack[sp - 2]; stack[sp - 2] = t; }
            break;
        case OP_JNZ:
            if (sp >= 1 && stack[sp - 1]) pc = code[pc]; else pc++;
            break;
        case OP_DEC:
            if (sp >= 1) stack[sp - 1]--;
            break;
        case OP_XOR:
            if (sp >= 2) { stack[sp - 2] ^= stack[sp - 1] * 31; sp--; }
            break;
        case OP_SHL:
            if (sp >= 1) stack[sp - 1] <<= 1;
            break;
        case OP_HALT:
            return sp ? stack[sp - 1] : 0;
        default:
            return ~0ul;
        }
    }
    return sp ? stack[sp - 1] : steps;
}

/* ---- hash table with chaining ---- */

struct hentry {
    u64 key;
    u64 count;
    struct hentry *next;
};

#define HBUCKETS 16
static struct hentry *hbuckets[HBUCKETS];
static struct hentry hpool[64];
static int hused;

noinline u64 hash64(u64 k)
{
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ul;
    k ^= k >> 29;
    return k;
}

noinline struct hentry *hash_lookup(u64 key)
{
    for (struct hentry *e = hbuckets[hash64(key) % HBUCKETS]; e; e = e->next)
        if (e->key == key)
            return e;
    return NULL;
}

noinline int hash_bump(u64 key)
{
    struct hentry *e = hash_lookup(key);
    if (e) {
        e->count++;
        return 0;
    }
    if (hused >= 64)
        return -12;
    e = &hpool[hused++];
    u64 b = hash64(key) % HBUCKETS;
    e->key = key;
    e->count = 1;
    e->next = hbuckets[b];
    hbuckets[b] = e;
    return 1;
}

/* ---- system calls: a table of function pointers ---- */

struct pt_regs {
    u64 nr;
    u64 di, si, dx;
    s64 ax;
};

typedef s64 (*sys_call_ptr_t)(const struct pt_regs *);

static s64 sys_read(const struct pt_regs *r)
{
    if (r->di >= NFILES || !files[r->di].f_op)
        return -9;
    struct file *f = &files[r->di];
    return f->f_op->read(f, (u8 *)r->si, r->dx);
}

static s64 sys_write(const struct pt_regs *r)
{
    if (r->di >= NFILES || !files[r->di].f_op)
        return -9;
    struct file *f = &files[r->di];
    return f->f_op->write(f, (const u8 *)r->si, r->dx);
}

static s64 sys_ioctl(const struct pt_regs *r)
{
    if (r->di >= NFILES || !files[r->di].f_op)
        return -9;
    struct file *f = &files[r->di];
    /* a tail call through a function pointer */
    return f->f_op->ioctl(f, (u32)r->si, r->dx);
}

static s64 sys_getpid(const struct pt_regs *r)
{
    (void)r;
    struct task *t = pick_next();
    return t ? t->pid : 0;
}

static s64 sys_sched_yield(const struct pt_regs *r)
{
    schedule_tick(r->di);
    return 0;
}

static s64 sys_spawn(const struct pt_regs *r)
{
    struct task *t = task_create((const char *)r->di, (int)r->si);
    return t ? t->pid : -11;
}

static s64 sys_tree(const struct pt_regs *r)
{
    static struct tnode *root;
    root = tree_insert(root, r->di, r->si);
    return (s64)tree_sum(root, 0) + tree_height(root);
}

static s64 sys_compute(const struct pt_regs *r)
{
    switch (r->di & 7) {
    case 0:
        return (s64)fib((u32)(r->si % 16));
    case 1:
        return (s64)gcd(r->si, r->dx);
    case 2:
        return hash_bump(r->si);
    case 3: {
        struct hentry *e = hash_lookup(r->si);
        return e ? (s64)e->count : -2;
    }
    default:
        /* tail call */
        return (s64)mix(r->si, r->dx);
    }
}

static s64 sys_ni(const struct pt_regs *r)
{
    (void)r;
    return -38;
}

static const sys_call_ptr_t sys_call_table[] = {
    sys_read, sys_write, sys_ioctl, sys_getpid, sys_sched_yield,
    sys_spawn, sys_tree, sys_compute, sys_ni,
};

#define NR_SYSCALLS (sizeof(sys_call_table) / sizeof(sys_call_table[0]))

noinline s64 do_syscall(struct pt_regs *r)
{
    if (r->nr >= NR_SYSCALLS) {
        r->ax = -38;
        return r->ax;
    }
    r->ax = sys_call_table[r->nr](r);
    return r->ax;
}

noinline s64 syscall3(u64 nr, u64 a, u64 b, u64 c)
{
    struct pt_regs r = { nr, a, b, c, 0 };
    return do_syscall(&r);
}

/* ---- the script ---- */

static const char *const names[] = { "init", "kthreadd", "rcu_gp", "ksoftirqd", "kworker", "sshd", "bash", "cron" };
static const u8 program[] = {
    OP_PUSH, 1, OP_PUSH, 9, /* acc, n */
    /* loop at 4: acc = acc * 3 ^ n; n-- */
    OP_SWAP, OP_PUSH, 3, OP_MUL, OP_SHL, OP_SWAP, OP_DUP, OP_PUSH, 5, OP_XOR,
    OP_SWAP, OP_DEC, OP_DUP, OP_SWAP, OP_SUB, OP_ADD, OP_DEC, OP_JNZ, 4,
    OP_ADD, OP_HALT,
};
static u64 sorted[48];
static u8 buf[192];
static s64 results[64];
static int nresults;

noinline void record(s64 v)
{
    if (nresults < 64)
        results[nresults++] = v;
}

noinline u64 kmain(void)
{
    u64 h = 0x65786f746170ul;
    list_init(&runqueue);
    crc32_init();
    files[0].f_op = &ramfs_fops;
    files[1].f_op = &zero_fops;
    files[2].f_op = &ramfs_fops;

    for (u64 i = 0; i < 8; i++)
        record(syscall3(5, (u64)names[i], (i * 7) % 5, 0));
    for (u64 i = 0; i < sizeof(buf); i++)
        buf[i] = (u8)(i * 13 + 7);
    record(syscall3(1, 0, (u64)buf, 100));
    record(syscall3(1, 2, (u64)buf + 50, 120));
    record(syscall3(2, 0, 1, 10));
    record(syscall3(0, 0, (u64)buf, 64));
    record(syscall3(0, 1, (u64)buf + 64, 16));
    record(syscall3(2, 0, 3, 0));
    record(syscall3(2, 2, 3, 0));
    record(syscall3(2, 1, 3, 0));
    record(syscall3(0, 3, (u64)buf, 4));
    record(syscall3(42, 0, 0, 0));
    for (u64 i = 0; i < 24; i++) {
        record(syscall3(4, i * 5 + 1, 0, 0));
        record(syscall3(3, 0, 0, 0));
        record(syscall3(6, hash64(i) % 97, i + 1, 0));
        record(syscall3(7, i, i * i + 3, i * 7 + 12));
    }
    struct task *t = find_task("bash");
    record(t ? (s64)t->runtime : -1);
    record(find_task("nobody") ? 1 : 0);
    for (u64 i = 0; i < 48; i++)
        sorted[i] = hash64(i * 31 + 5) % 1000;
    sort(sorted, 0, 47);
    for (u64 i = 0; i < 48; i++)
        h = mix(h, sorted[i]);
    record((s64)interp(program, sizeof(program)));
    for (struct list_head *p = runqueue.next; p != &runqueue; p = p->next) {
        struct task *tk = container_of(p, struct task, node);
        h = mix(h, (u64)tk->pid << 32 | (u32)tk->prio);
        h = mix(h, tk->runtime);
    }
    for (int i = 0; i < nresults; i++)
        h = mix(h, (u64)results[i]);
    h = mix(h, crc32(0, buf, sizeof(buf)));
    return h;
}
