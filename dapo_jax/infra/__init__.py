"""Infrastructure: files on any filesystem, metrics and logs, the compile cache, multi-host
start-up, libtpu flags, meshes and sharding rules, tracing."""
