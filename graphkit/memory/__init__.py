"""Device memory: transactions, address ranges, backing chunks and their sleep, the shared allocator, elastic
buffers and ranges shared between processes. Nothing here knows about graphs."""
