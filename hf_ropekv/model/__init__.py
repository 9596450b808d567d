"""What hf_ropekv reads from a model: geometry, rotary layout, query capture, attention."""
