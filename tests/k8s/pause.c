/* The Pod sandbox's process (the "pause" container) of the test node: it holds the Pod's
 * namespaces, reaps the zombies a shared PID namespace hands it as PID 1, and exits 0 on
 * SIGINT or SIGTERM. Built static by scripts/build-node.sh and put alone in an image
 * (tests/k8s/images.py), since no registry can be reached here. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction act = {0};
    act.sa_handler = stop;
    sigaction(SIGINT, &act, NULL);
    sigaction(SIGTERM, &act, NULL);
    act.sa_handler = reap;
    act.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigaction(SIGCHLD, &act, NULL);
    for (;;) pause();
}
