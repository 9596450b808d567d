"""The cache transformers sees (RopeKVCache), its layers, and what it reports."""
