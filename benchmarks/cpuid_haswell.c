/*
 * cpuid_haswell.so: run a process natively while its cpuid reports a Haswell-class CPU.
 *
 * Libraries that pick kernels by cpuid (onnxruntime's MLAS, oneDNN, numpy) then dispatch the code an
 * AVX2-only laptop would run (no AVX-512, no VNNI, no AMX), at native speed instead of qemu's ~100x
 * slowdown. It needs CPUID faulting (the `cpuid_fault` flag in /proc/cpuinfo, Linux >= 4.12): the
 * kernel turns every cpuid instruction into a SIGSEGV, and the handler below executes the real cpuid
 * with faulting briefly off, clears the feature bits Haswell lacks, and resumes after the instruction.
 *
 *     gcc -O2 -shared -fPIC -o /tmp/cpuid_haswell.so benchmarks/cpuid_haswell.c
 *     LD_PRELOAD=/tmp/cpuid_haswell.so python benchmarks/int8_cpu_classes.py score W haswell-avx2
 *
 * What it does not hide: instructions themselves still run (the masked features are only unadvertised),
 * xgetbv still reports the AVX-512 register state, and the dynamic loader's own probe (glibc's string
 * functions) ran before this library loaded. Code that asks cpuid before dispatching, as the kernel
 * libraries above do, sees Haswell. A SIGSEGV handler installed later by the process replaces this one;
 * the scoring step installs none.
 */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static int set_cpuid_faulting(int on) {
    /* ARCH_SET_CPUID's argument is "cpuid allowed": 0 makes it fault; per thread, inherited by clones */
    return (int)syscall(SYS_arch_prctl, ARCH_SET_CPUID, on ? 0 : 1);
}

/* Haswell's leaf 7 subleaf 0 EBX: FSGSBASE, TSC_ADJUST, BMI1, HLE, AVX2, SMEP, BMI2, ERMS, INVPCID, RTM */
#define HASWELL_7_EBX ((1u << 0) | (1u << 1) | (1u << 3) | (1u << 4) | (1u << 5) | (1u << 7) | (1u << 8) | \
                       (1u << 9) | (1u << 10) | (1u << 11))
/* leaf 7 EDX bits 26-31 are speculation-control flags, not instruction sets: kept */
#define SPEC_CTRL_7_EDX (0x3fu << 26)

static void mask_haswell(uint32_t leaf, uint32_t subleaf, uint32_t r[4]) {
    if (leaf == 7 && subleaf == 0) {
        r[0] = 0; /* highest subleaf: Haswell has none beyond 0 (AVX-VNNI, AVX512_BF16 live in subleaf 1) */
        r[1] &= HASWELL_7_EBX;
        r[2] = 0; /* AVX512_VNNI, VBMI, GFNI, VAES, ... */
        r[3] &= SPEC_CTRL_7_EDX; /* AMX, AVX512_FP16, ... */
    } else if (leaf == 7 || leaf == 0x1d || leaf == 0x1e || leaf == 0x24) {
        r[0] = r[1] = r[2] = r[3] = 0; /* subleaf 1+ of 7, AMX tile and TMUL info, AVX10 */
    } else if (leaf == 0xd && subleaf == 0) {
        r[0] &= 0x7; /* XSAVE state components: x87, SSE, AVX only */
    }
}

static void on_sigsegv(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = context;
    greg_t *g = uc->uc_mcontext.gregs;
    const uint8_t *ip = (const uint8_t *)g[REG_RIP];
    if (info->si_code != SI_KERNEL || ip[0] != 0x0f || ip[1] != 0xa2) {
        signal(sig, SIG_DFL); /* a real fault: let it happen again, unhandled */
        return;
    }
    uint32_t leaf = (uint32_t)g[REG_RAX], subleaf = (uint32_t)g[REG_RCX], r[4];
    set_cpuid_faulting(0);
    __cpuid_count(leaf, subleaf, r[0], r[1], r[2], r[3]);
    set_cpuid_faulting(1);
    mask_haswell(leaf, subleaf, r);
    g[REG_RAX] = r[0];
    g[REG_RBX] = r[1];
    g[REG_RCX] = r[2];
    g[REG_RDX] = r[3];
    g[REG_RIP] += 2;
}

__attribute__((constructor)) static void install(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_sigsegv;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGSEGV, &action, NULL) != 0 || set_cpuid_faulting(1) != 0) {
        fprintf(stderr, "cpuid_haswell: this CPU or kernel has no CPUID faulting (cpuid_fault); "
                        "use qemu-x86_64 -cpu Haswell instead\n");
        exit(2);
    }
}
