/* AMX tiles (Sapphire Rapids and later) for the kernels that take them: Linux's permission to use the tiles'
 * state, a configuration of the first `count` tiles as 16 rows of 64 bytes, and their release. x86-64 Linux
 * only: a kernel includes this under its own guard. */
#ifndef PAGEDSERVE_AMX_H
#define PAGEDSERVE_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Whether Linux lets this process use the tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA). The
 * permission is the process's: every kernel that asks gets the same answer. */
static inline int amx_permitted(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* Tiles 0 .. count - 1 as 16 rows of 64 bytes. A kernel configures them at each call, as kernels share threads. */
__attribute__((target("amx-tile"), unused)) static void amx_configure(int count)
{
    struct amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < count; t++) {
        config.rows[t] = 16;
        config.bytes_per_row[t] = 64;
    }
    /* the whole configuration as the operand: GCC's _tile_loadconfig names only its first eight bytes, so the
     * stores of the rest could be dropped */
    __asm__ volatile("ldtilecfg %0" ::"m"(config));
}

__attribute__((target("amx-tile"), unused)) static void amx_release(void) { _tile_release(); }

/* GCC's tile loads and stores pass their memory only as an address, so it may move the stores a tile load reads
 * after it, or a tile store's readers before it (it did, at -O3, for a buffer of codes unpacked and tile-loaded in
 * one function): a kernel puts this between them. */
#define AMX_MEMORY_IN_ORDER() __asm__ volatile("" ::: "memory")

#endif
