/* A relocatable object shaped like a kernel module, for exotap's reading of a module's DWARF
 * (introspect/src/dwarf/relocatable): built by the tests with `gcc -g -O2 -c`, so every
 * address and string offset in its DWARF is a relocation. Functions in .text and in an init
 * section (as module_init's are), and a global in .data; another global declared as a
 * header declares it and defined after (its DWARF definition a DW_AT_specification of the
 * declaration), whose member the code reaches RIP-relative (a relocation of .text). */

struct counter {
	long hits;
	const char *name;
};

struct counter module_counter = { 0, "module_like" };

__attribute__((noinline)) long count_hit(struct counter *c, long by)
{
	c->hits += by;
	return c->hits;
}

__attribute__((noinline, section(".init.text"))) int module_like_init(int arg)
{
	return (int)count_hit(&module_counter, arg);
}

extern struct counter shared_counter;

struct counter shared_counter = { 0, "shared" };

__attribute__((noinline)) long bump_shared(long by)
{
	shared_counter.hits += by;
	return shared_counter.hits;
}
