/* A library the dynamic loader refuses (RTLD_NOW: an undefined symbol): the
 * loader's message must carry dlerror()'s reason, nothing else. Built without
 * loom_add_plugin's --no-undefined. */
extern int loom_test_no_such_symbol;
int loom_test_reads_a_missing_symbol(void);
int loom_test_reads_a_missing_symbol(void) { return loom_test_no_such_symbol; }
