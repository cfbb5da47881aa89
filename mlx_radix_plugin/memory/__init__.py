"""KV memory: the page allocator and the radix tree (pure Python), the pool, the budget."""
