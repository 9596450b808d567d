"""What ties hf_ropekv to a model: its shared forward hooks, each cache's attachment, the generate-method wrappers
and the CUDA-graph decode step."""
