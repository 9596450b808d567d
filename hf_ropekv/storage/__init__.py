"""Where keys and values live: paged growing arenas, fixed static arenas, and the buffer pool."""
