"""What ties hf_ropekv to a model: per-cache hooks and enable()."""
