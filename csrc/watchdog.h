/* The freeze watchdog personality of bunshin-init (csrc/watchdog.c). */
int watchdog_main(int argc, char **argv);
