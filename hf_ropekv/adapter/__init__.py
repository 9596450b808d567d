"""What ties hf_ropekv to a model: the forward hooks one model shares, each cache's attachment, the generate-method wrappers and the CUDA-graph decode step."""
