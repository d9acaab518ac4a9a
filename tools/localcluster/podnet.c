/* LD_PRELOAD shim for process-backed pods (tools/localcluster/podrunner.py).
 *
 * On a real node every pod has its own network namespace, so two pods may both listen on
 * 0.0.0.0:9400. Here all pods share the host's network, and each gets its own loopback address
 * instead (LOCALPOD_IP, e.g. 127.1.0.7). This shim turns a bind() to the wildcard address
 * (0.0.0.0 or ::) into a bind() to that address, so listeners of different pods never collide
 * and peers reach each one at its pod IP. Binds to a specific address are left alone.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *ip = getenv("LOCALPOD_IP");
    if (ip && addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY) && inet_pton(AF_INET, ip, &a.sin_addr) == 1)
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
    } else if (ip && addr && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        char mapped[64];
        int v6only = 0;
        socklen_t optlen = sizeof v6only;
        memcpy(&a, addr, sizeof a);
        getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &optlen);
        snprintf(mapped, sizeof mapped, "::ffff:%s", ip);
        /* A dual-stack socket on :: becomes one on the pod's IPv4 address (v4-mapped). */
        if (!v6only && IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr) && inet_pton(AF_INET6, mapped, &a.sin6_addr) == 1)
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
    }
    return real_bind(fd, addr, len);
}
