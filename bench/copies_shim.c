/* memcpy and memmove counted by call site and size, for bench/copies.sh.
 *
 * Loaded with LD_PRELOAD into the proxy: each copy records its caller's
 * return address, how often, how many bytes, and the last size. Counting
 * is off until the first SIGUSR2 (which clears the table), and the second
 * writes the table and the process's maps to COPIES_OUT.{sites,maps}.
 * The copies themselves are plain `rep movsb` and byte loops: slower than
 * glibc's, which does not matter, as only calls and sizes are counted.
 * A spin lock keeps the table whole when several threads copy at once.
 * The proxy installs no SIGUSR2 handler of its own (it would replace this
 * one). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SLOTS 65536
static struct {
    uintptr_t site;
    uint64_t calls, bytes;
    uint32_t last;
} table[SLOTS];
static volatile int counting;
static volatile int lock;

static void copy_out(const char *suffix, int in, char *line, size_t room) {
    char path[4096];
    const char *out = getenv("COPIES_OUT");
    snprintf(path, sizeof path, "%s.%s", out ? out : "/tmp/copies", suffix);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return;
    if (in >= 0) {
        ssize_t n;
        while ((n = read(in, line, room)) > 0) (void)!write(fd, line, n);
    } else {
        for (int i = 0; i < SLOTS; i++) {
            if (!table[i].calls) continue;
            int n = snprintf(line, room, "%lx %lu %lu %u\n", (unsigned long)table[i].site,
                             (unsigned long)table[i].calls, (unsigned long)table[i].bytes,
                             table[i].last);
            (void)!write(fd, line, n);
        }
    }
    close(fd);
}

static void toggle(int sig) {
    (void)sig;
    char line[4096];
    if (!counting) {
        memset(table, 0, sizeof table);
        counting = 1;
        return;
    }
    counting = 0;
    copy_out("sites", -1, line, sizeof line);
    int maps = open("/proc/self/maps", O_RDONLY);
    copy_out("maps", maps, line, sizeof line);
    if (maps >= 0) close(maps);
}

__attribute__((constructor)) static void start(void) { signal(SIGUSR2, toggle); }

static inline void note(void *site, size_t n) {
    if (!counting) return;
    while (__atomic_exchange_n(&lock, 1, __ATOMIC_ACQUIRE)) {}
    uintptr_t a = (uintptr_t)site;
    size_t h = (a >> 2) & (SLOTS - 1);
    while (table[h].site && table[h].site != a) h = (h + 1) & (SLOTS - 1);
    table[h].site = a;
    table[h].calls++;
    table[h].bytes += n;
    table[h].last = (uint32_t)n;
    __atomic_store_n(&lock, 0, __ATOMIC_RELEASE);
}

void *memcpy(void *dst, const void *src, size_t n) {
    note(__builtin_return_address(0), n);
    void *d = dst;
    __asm__ volatile("rep movsb" : "+D"(d), "+S"(src), "+c"(n) : : "memory");
    return dst;
}

void *memmove(void *dst, const void *src, size_t n) {
    note(__builtin_return_address(0), n);
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (d < s) {
        for (size_t i = 0; i < n; i++) d[i] = s[i];
    } else {
        for (size_t i = n; i > 0; i--) d[i - 1] = s[i - 1];
    }
    return dst;
}
